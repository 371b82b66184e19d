"""A request the router gives up on before any byte reached the client is retried on an engine that became routable
while it waited, not only on the engines routable when it was ranked.

Regression (issue 16, found by bench/soak.py): with engine A killed and restarting, requests went to B alone; B was
then frozen (SIGSTOP), and once the router gave B up as stalled those requests got a 503 "no engine could take the
request", although A was healthy again by then. In-process: the router in front of two fake engines (the real engine
HTTP app on ``FakeEngine``), one not admitted yet (its probes answer 503) when the request is ranked.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from fake_engine import FakeEngine, ServerThread, load_tokenizer, wait_until

MODEL = "smollm2-135m-instruct"
GENERATE = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})


class _Freezing:
    """An engine app that, once ``arrived`` (a generation request came), answers nothing more until ``release``
    when ``frozen`` is set: its requests and probes hang, as a SIGSTOPped engine's do."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.arrived, self.frozen, self.release = threading.Event(), threading.Event(), threading.Event()

    async def _hang(self) -> None:
        while not self.release.is_set():
            await asyncio.sleep(0.05)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in GENERATE:
            self.arrived.set()
            await self._hang()
            return
        if scope["type"] == "http" and self.frozen.is_set():
            await self._hang()
            return
        await self.app(scope, receive, send)


class _Gated:
    """An engine app whose probes answer 503 until ``open`` is set: an engine still starting (or restarting)."""

    def __init__(self, app: Any) -> None:
        self.app, self.open = app, threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self.open.is_set() and scope["path"] in ("/health", "/v1/models"):
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": b'{"error": {"message": "starting", "code": 503}}'})
            return
        await self.app(scope, receive, send)


def _routable(url: str) -> int:
    return int(httpx.get(url + "/health", timeout=5).json()["routable_workers"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_stalled_request_moves_to_an_engine_that_came_back_meanwhile(stream: bool) -> None:
    from radixserve.engine.server.http import create_app as engine_app
    from radixserve.router.app import create_app as router_app
    from radixserve.router.config import RouterArgs

    tok = load_tokenizer()
    sick = _Freezing(engine_app(FakeEngine(tok), manage_engine=False))
    back = _Gated(engine_app(FakeEngine(tok), manage_engine=False))
    with ServerThread(sick) as sick_url, ServerThread(back) as back_url:
        args = RouterArgs(
            worker_urls=[sick_url, back_url],
            health_interval_s=0.2,
            pending_probe_interval_s=0.1,
            engine_stall_timeout_s=1.5,
            cache_events_interval_s=0,
        )
        try:
            with ServerThread(router_app(args)) as url:
                assert wait_until(lambda: _routable(url) == 1, 30)  # only the sick engine: ranked alone
                body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": stream}
                reply: dict[str, httpx.Response] = {}

                def post() -> None:
                    reply["r"] = httpx.post(url + "/v1/completions", json=body, timeout=60)

                client = threading.Thread(target=post, daemon=True)
                client.start()
                assert sick.arrived.wait(10)
                back.open.set()  # the other engine comes back while the request waits on the sick one
                assert wait_until(lambda: _routable(url) == 2, 30)
                sick.frozen.set()  # now the sick one stops answering its probes too: stalled after 1.5 s
                client.join(30)
                assert not client.is_alive(), "the request hung"
        finally:
            sick.release.set()
    r = reply["r"]
    assert r.status_code == 200, r.text  # was: 503 "no engine could take the request (... stalled ...)"
    assert r.headers["x-radixserve-worker"] == back_url and r.headers["x-radixserve-route-reason"] == "retry"
    if stream:
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
