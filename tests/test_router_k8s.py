"""The router with Kubernetes discovery, end to end: EndpointSlices in an emulated API server (tests/k8s_emulator.py)
point at real engine HTTP layers over fake engines; the router built from ``--service-discovery`` flags finds them,
routes to them, and follows readiness changes and deletions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import pytest

from radixserve.contracts import constants
from radixserve.engine.server.http import create_app as engine_app
from radixserve.router.app import create_app
from radixserve.router.config import RouterArgs
from test_router_discovery import NS, SLICES, create, ep, make_slice, patch

from fake_engine import FakeEngine, ServerThread, load_tokenizer
from k8s_emulator import k8s  # noqa: F401 - pytest fixture

SERVICE = "demo-engine"


async def poll(client: httpx.AsyncClient, url: str, predicate: Any, timeout_s: float = 30) -> dict[str, Any]:
    """GET ``url``/health until ``predicate(body)`` holds; the event loop keeps serving the emulator meanwhile."""
    deadline = time.monotonic() + timeout_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = (await client.get(url + "/health")).json()
        if predicate(body):
            return body
        await asyncio.sleep(0.1)
    pytest.fail(f"router health never satisfied the condition: {body}")


@pytest.mark.asyncio
async def test_router_follows_endpointslices(k8s):
    emulator, _ = k8s
    tok = load_tokenizer()
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(ServerThread(engine_app(FakeEngine(tok), manage_engine=False))) for _ in range(2)]
        ports = [int(u.rsplit(":", 1)[1]) for u in urls]
        args = RouterArgs(
            service_discovery=True, namespace=NS, service_name=SERVICE, health_interval_s=0.3, discovery_relist_s=5
        )
        router = stack.enter_context(ServerThread(create_app(args)))
        async with httpx.AsyncClient(timeout=30) as client:
            body = await poll(client, router, lambda b: b["discovery"]["age_s"] is not None)
            assert body["discovery"]["kind"] == "kubernetes" and body["routable_workers"] == 0
            assert (await client.get(router + constants.ROUTER_READY_PATH)).status_code == 503

            # One slice per engine port (a slice has one port list for all its endpoints).
            await create(emulator, make_slice("demo-engine-a", SERVICE, [ep("127.0.0.1", "pod-a")], port=ports[0]))
            await poll(client, router, lambda b: b["routable_workers"] == 1)
            r = await client.post(router + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 200 and r.headers[constants.HEADER_WORKER] == urls[0]

            await create(emulator, make_slice("demo-engine-b", SERVICE, [ep("127.0.0.1", "pod-b")], port=ports[1]))
            body = await poll(client, router, lambda b: b["routable_workers"] == 2)
            assert {w["pod"] for w in body["workers"]} == {"pod-a", "pod-b"}

            # Pod a stops being ready: it leaves the routable set, and every request goes to b.
            await patch(emulator, "demo-engine-a", {"endpoints": [ep("127.0.0.1", "pod-a", ready=False)]})
            await poll(client, router, lambda b: [w["url"] for w in b["workers"]] == [urls[1]])
            for i in range(4):
                r = await client.post(router + "/v1/completions", json={"prompt": f"Q{i} " * 20, "max_tokens": 2})
                assert r.status_code == 200 and r.headers[constants.HEADER_WORKER] == urls[1]

            # Slice b deleted: nothing routable, OpenAI-format 503, not a refused connection.
            resp = await emulator.delete(f"{SLICES}/demo-engine-b")
            assert resp.status == 200
            await poll(client, router, lambda b: b["routable_workers"] == 0)
            r = await client.post(router + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["type"] == constants.ERROR_TYPES[503]
            body = (await client.get(router + "/health")).json()
            assert body["discovery"]["stale"] is False and body["discovery"]["last_error"] is None
