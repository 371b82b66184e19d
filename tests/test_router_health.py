"""Why the router can or cannot route, as a newcomer sees it (issue 11): one WARNING per worker state change with its
reason (401, refused connections, a SIGKILLed engine), ``/health`` by routability, ``/live``, and route reasons that
say what the router knew (``cold`` for a fresh prompt, ``cache-affinity`` for one it sent before)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx
import pytest

from radixserve.contracts import constants
from radixserve.engine.server.http import create_app as engine_app
from radixserve.router.app import create_app
from radixserve.router.config import RouterArgs
from test_router_app import MODEL, assert_error, dead_url, engines, health, router, state_lines
from test_router_policy import newcomer_chat

from conftest import free_port
from fake_engine import FakeEngine, ServerThread, load_tokenizer, wait_until

KEY_HINT = "(is --engine-api-key / RADIXSERVE_ENGINE_API_KEY set to the engine's key?)"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


@pytest.fixture
def router_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="radixserve.router")
    return caplog


def test_engine_behind_an_api_key_is_ejected_with_the_reason_and_health_says_unavailable(tok, router_log):
    # Issue 11: an engine behind --api-key, a router without --engine-api-key: every request was 503 "no engine is
    # available", nothing was logged, and /health said "ok" with routable_workers 0.
    fake = FakeEngine(tok, api_key="engine-key")
    with (
        ServerThread(engine_app(fake, manage_engine=False)) as url,
        router([url], wait_for=0, health_interval_s=0.2, pending_probe_interval_s=0.05) as r,
    ):
        assert wait_until(lambda: health(r)["workers"][0]["state"] == "ejected", 10)
        time.sleep(1.0)  # five more refused probes: still one line
        h = httpx.get(r + constants.ROUTER_HEALTH_PATH)
        assert h.status_code == 503 and h.json()["status"] == "unavailable" and h.json()["routable_workers"] == 0
        assert h.json()["workers"][0]["last_error"] == "401 Unauthorized from GET /v1/models " + KEY_HINT
        # Round 2: clients got "no engine is ready yet (0 of 1 routable); retry shortly" for a misconfiguration that
        # never clears, and no Retry-After. They get the reason, and the readmission delay to wait.
        why = "no engine is routable (0 of 1): 1 ejected after 401 Unauthorized from GET /v1/models " + KEY_HINT
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        for resp in (
            httpx.post(r + "/v1/completions", json={"prompt": "x", "max_tokens": 2}),
            httpx.post(r + "/v1/chat/completions", json=chat),
            httpx.get(r + "/v1/models"),
            httpx.get(r + constants.ROUTER_READY_PATH),
        ):
            assert assert_error(resp, 503)["message"] == why
            assert resp.headers["retry-after"] == "10"  # --readmit-after-s, not 1: this is no engine still loading
        assert h.headers["retry-after"] == "10"
        assert httpx.get(r + constants.ROUTER_LIVE_PATH).status_code == 200  # the process itself is fine
    assert state_lines(router_log, url) == [
        f"WARNING worker {url} ejected: 401 Unauthorized from GET /v1/models {KEY_HINT}"
    ]
    # The same engine with the key: admitted, no warning.
    router_log.clear()
    with ServerThread(engine_app(fake, manage_engine=False)) as url, router([url], engine_api_key="engine-key") as r:
        assert health(r)["status"] == "ok" and health(r)["workers"][0]["state"] == "healthy"
    assert state_lines(router_log, url) == []


_TINY_ENGINE = """
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


async def health(request):
    return Response()


async def models(request):
    return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})


async def tokenizer(request):
    return Response(status_code=404)


routes = [Route("/health", health), Route("/v1/models", models), Route("/get_tokenizer_files", tokenizer)]
uvicorn.run(Starlette(routes=routes), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_sigkilled_engine_is_ejected_with_a_line(tmp_path, router_log):
    # Issue 11: an engine killed with SIGKILL produced no router log line.
    script = tmp_path / "tiny_engine.py"
    script.write_text(_TINY_ENGINE)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, str(script), str(port)])
    try:
        with router([url], health_interval_s=0.2, eject_after_failures=2) as r:
            assert health(r)["status"] == "ok"
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            assert wait_until(lambda: health(r)["workers"][0]["state"] == "ejected", 10)
            time.sleep(0.6)  # more refused probes: no more lines
            assert httpx.get(r + constants.ROUTER_HEALTH_PATH).status_code == 503
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert state_lines(router_log, url) == [
        f"WARNING worker {url} ejected: connection refused on GET /health (2 failures in a row)"
    ]


def test_nothing_listening_is_said_once_while_the_worker_stays_pending(router_log):
    url = dead_url()
    app = create_app(RouterArgs(worker_urls=[url], pending_probe_interval_s=0.05))
    app.state.pool.pending_warn_s = 0.3
    with ServerThread(app) as r:
        assert wait_until(lambda: state_lines(router_log, url), 10)
        time.sleep(0.5)  # ten more refused probes
        assert health(r)["workers"][0]["state"] == "pending"  # may be an engine still loading: not ejected
    assert state_lines(router_log, url) == [
        f"WARNING worker {url} not admitted after 0 s: connection refused on GET /health (an engine still loading, "
        "or none at this URL)"
    ]


def test_health_degraded_while_some_workers_are_routable_and_live_is_open(tok):
    with engines(tok, 2) as (fakes, urls), router(urls, api_key="sekret", eject_after_failures=1) as r:
        assert health(r)["status"] == "ok"
        fakes[1].healthy = False
        assert wait_until(lambda: health(r)["routable_workers"] == 1, 10)
        h = httpx.get(r + constants.ROUTER_HEALTH_PATH)
        assert h.status_code == 200 and h.json()["status"] == "degraded"
        assert {w["url"]: w["state"] for w in h.json()["workers"]} == {urls[0]: "healthy", urls[1]: "ejected"}
        live = httpx.get(r + constants.ROUTER_LIVE_PATH)  # no key: probes carry none
        assert live.status_code == 200 and live.json() == {"status": "live"}
        assert_error(httpx.get(r + "/v1/models"), 401)  # while the API is closed


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fresh_prompt_is_cold_then_cache_affinity(tok, path):
    # Issue 11: "x-radixserve-route-reason: prefix-hit" was sent on cold requests, cached_tokens 0.
    fresh = f"{uuid.uuid4().hex} starts a prompt no engine has seen. " * 4  # several blocks, the first one unique
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2}
    if path == "/v1/completions":
        body["prompt"] = fresh
    else:
        body["messages"] = [{"role": "system", "content": fresh}, {"role": "user", "content": "Hi."}]
    with engines(tok, 2) as (_, urls), router(urls) as r:
        first = httpx.post(r + path, json=body, timeout=30)
        again = httpx.post(r + path, json=body, timeout=30)
        assert first.status_code == again.status_code == 200
        assert first.headers[constants.HEADER_ROUTE_REASON] == "cold"
        assert again.headers[constants.HEADER_ROUTE_REASON] == "cache-affinity"
        assert again.headers[constants.HEADER_WORKER] == first.headers[constants.HEADER_WORKER]
        text = httpx.get(r + "/metrics").text
        assert 'radixserve_router_decisions_total{reason="cold"} 1.0' in text
        assert 'radixserve_router_decisions_total{reason="cache-affinity"} 1.0' in text


def test_distinct_chats_and_short_completions_spread_over_both_engines(tok):
    # Newcomer trial, round 2: ten different 200-word chats all went to one of two engines as cache-affinity (the
    # chat template's system prompt was the only shared block), and 8 short completions all to one engine.
    with engines(tok, 2) as (_, urls), router(urls) as r:
        chats = []
        for i in range(10):
            body = newcomer_chat(i)
            body["messages"] = body["messages"][1:]  # the template adds that system prompt itself
            chats.append(httpx.post(r + "/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=30))
        assert all(resp.status_code == 200 for resp in chats)
        assert {resp.headers[constants.HEADER_ROUTE_REASON] for resp in chats} == {"cold"}
        assert {resp.headers[constants.HEADER_WORKER] for resp in chats} == set(urls)
        again = httpx.post(r + "/v1/chat/completions", json={**newcomer_chat(3), "max_tokens": 1}, timeout=30)
        assert again.headers[constants.HEADER_WORKER] == chats[3].headers[constants.HEADER_WORKER]
        assert again.headers[constants.HEADER_ROUTE_REASON] == "cache-affinity"
        short = [
            httpx.post(r + "/v1/completions", json={"prompt": f"Story number {i}: Once upon a time", "max_tokens": 1})
            for i in range(8)
        ]
        assert {resp.headers[constants.HEADER_WORKER] for resp in short} == set(urls)


def test_a_new_worker_is_said_to_serve_its_model_once(tok, router_log):
    # Newcomer trial, round 2: "worker URL serves MODEL" came twice at start-up (discovery's first probe and the probe
    # loop's both read the models while the tokenizer was being fetched).
    with engines(tok, 1) as (_, urls), router(urls, pending_probe_interval_s=0.01) as r:
        assert health(r)["status"] == "ok"
    lines = state_lines(router_log, urls[0], logging.INFO)
    assert lines.count(f"INFO worker {urls[0]} serves {MODEL}") == 1
    assert lines.count(f"INFO worker {urls[0]} ready") == 1
