"""The router's graceful drain in process (docs/contracts.md, "Graceful drain"): ``Proxy.drain`` (what SIGTERM starts,
tests/test_router_process.py runs the signal itself) makes readiness and new requests 503 at once while requests in
flight go on, and a second signal (the drain cancelled) ends them at once with the error event; an engine that drains
(a 503 with ``x-radixserve-draining``) takes no new request from the router at once, without an ejection, and its
streams in flight are never given up as stalled, however long it drains."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve.contracts import constants
from radixserve.engine.server.http import create_app as engine_app
from radixserve.router.app import create_app
from radixserve.router.config import RouterArgs
from radixserve.router.proxy import Proxy
from test_router_process import LONG, Stream, wait_for

from draining_engine import DrainingEngineApp
from fake_engine import FakeEngine, ServerThread, load_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


@contextlib.contextmanager
def router(urls: list[str], **kw: Any) -> Iterator[tuple[str, Proxy, asyncio.AbstractEventLoop]]:
    """A router in front of ``urls``, every worker routable: (its URL, its proxy, the loop it serves on)."""
    kw.setdefault("health_interval_s", 0.3)
    app = create_app(RouterArgs(worker_urls=urls, **kw))
    thread = ServerThread(app)
    with thread as url:
        wait_for(lambda: httpx.get(url + "/health").json()["routable_workers"] == len(urls), 30, "routable")
        yield url, app.state.proxy, thread.server.servers[0].get_loop()


def slow_engine(tok: Any) -> FakeEngine:
    engine = FakeEngine(tok, delay_s=0.02)
    engine.set_outputs([LONG])
    return engine


def test_drain_refuses_new_requests_and_a_second_signal_ends_streams_at_once(tok: Any) -> None:
    engine = slow_engine(tok)
    with ServerThread(engine_app(engine, manage_engine=False)) as upstream, router([upstream]) as (url, proxy, loop):
        idle = asyncio.run_coroutine_threadsafe(proxy.drain(30), loop)  # nothing in flight: returns at once
        idle.result(timeout=2)
        proxy.inflight.draining = proxy.inflight.shutting_down = False  # undo, for the case under test
        stream = Stream(url, max_tokens=400)  # ~8 s
        drain = asyncio.run_coroutine_threadsafe(proxy.drain(30), loop)
        wait_for(lambda: proxy.draining, 2, "draining")
        for path in ("/ready", "/v1/models", "/health"):
            r = httpx.get(url + path)
            assert r.status_code == 503 and r.headers[constants.HEADER_DRAINING] == "1", (path, r.text)
        assert httpx.get(url + "/health").json()["status"] == "draining"
        assert httpx.get(url + "/live").status_code == 200  # the process serves: Kubernetes must not restart it
        refused = httpx.post(url + "/v1/completions", json={"prompt": "y", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers[constants.HEADER_DRAINING] == "1"
        assert refused.json()["error"]["code"] == 503
        assert stream.thread.is_alive() and not drain.done()
        t0 = time.monotonic()
        loop.call_soon_threadsafe(drain.cancel)  # what a second Ctrl-C does (contracts/serving.py)
        stream.thread.join(10)
        assert time.monotonic() - t0 < 5  # at once, not the 30 s bound
        wait_for(lambda: bool(engine.aborted), 5, "the engine's request aborted")
    events = stream.events()
    assert events[-1]["error"]["code"] == 503 and "shutting down" in events[-1]["error"]["message"]
    assert not any("error" in e for e in events[:-1])


def test_a_draining_engine_takes_no_new_request_and_its_streams_are_never_stalled(
    tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.router")
    apps = [DrainingEngineApp(engine_app(slow_engine(tok), manage_engine=False)) for _ in range(2)]
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(ServerThread(app)) for app in apps]
        # A stall bound far below the drain: a draining engine answers its probes, so it is never given up on.
        url, _, _ = stack.enter_context(router(urls, policy="round_robin", engine_stall_timeout_s=1.0))
        stream = Stream(url, max_tokens=150)  # ~3 s
        wait_for(lambda: sum(a.inflight for a in apps) == 1, 5, "the stream on an engine")
        drained = next(i for i, a in enumerate(apps) if a.inflight)
        other = urls[1 - drained]
        apps[drained].begin_drain()
        t0 = time.monotonic()
        for i in range(6):  # at once: whether the router's probe or this request finds the drain first
            r = httpx.post(url + "/v1/completions", json={"prompt": f"q{i}", "max_tokens": 2}, timeout=10)
            assert r.status_code == 200 and r.headers[constants.HEADER_WORKER] == other, r.text
        body = httpx.get(url + "/health").json()
        worker = next(w for w in body["workers"] if w["url"] == urls[drained])
        assert worker["draining"] is True and worker["state"] == "healthy" and body["routable_workers"] == 1
        stream.thread.join(30)
        assert time.monotonic() - t0 > 1.5  # it ran past the stall bound
    events = stream.events()
    assert not any("error" in e for e in events), events[-2:]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    text = caplog.text
    assert f"worker {urls[drained]} draining" in text and "stalled" not in text and "ejected" not in text
