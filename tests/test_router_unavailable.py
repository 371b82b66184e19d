"""Why nothing is routable, as a client reads it (newcomer trial, round 2, item 6): the router's 503 names engines
still starting apart from ejected ones and the reason they were ejected, and every 429 / 503 of router and engine
carries ``Retry-After`` (1 s for engines still starting or a full queue, ``--readmit-after-s`` for ejected ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from radixserve.engine.io_struct import InvalidRequestError
from radixserve.engine.server.http import create_app as engine_app
from radixserve.router.unavailable import unroutable
from test_router_app import MSGS, assert_error, engines, router

from fake_engine import load_tokenizer

KEY_HINT = "(is --engine-api-key / RADIXSERVE_ENGINE_API_KEY set to the engine's key?)"
UNAUTHORIZED = "401 Unauthorized from GET /v1/models " + KEY_HINT
QUEUE_FULL = InvalidRequestError("too many queued requests (max 256); retry later", status_code=429)


@dataclass
class Worker:
    """What ``unroutable`` reads of a ``WorkerState``."""

    state: str
    last_error: str | None = None
    models: tuple[str, ...] = ()
    draining: bool = False


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


def test_an_ejected_engine_is_named_with_its_reason_and_the_readmission_delay():
    # The newcomer's case: one engine behind --api-key, a router without --engine-api-key.
    why = unroutable([Worker("ejected", UNAUTHORIZED)], readmit_after_s=10.0)
    assert why.message == f"no engine is routable (0 of 1): 1 ejected after {UNAUTHORIZED}"
    assert why.retry_after_s == 10


def test_engines_still_starting_are_not_ready_yet_and_retried_soon():
    why = unroutable([Worker("pending", "connection refused on GET /health")] * 2, readmit_after_s=10.0)
    assert why.message == "no engine is ready yet (0 of 2 routable: 2 still starting); retry shortly"
    assert why.retry_after_s == 1
    mixed = unroutable([Worker("pending"), Worker("ejected", UNAUTHORIZED)], readmit_after_s=10.0)
    assert mixed.message == (
        f"no engine is ready yet (0 of 2 routable: 1 still starting; 1 ejected after {UNAUTHORIZED}); retry shortly"
    )
    assert mixed.retry_after_s == 1


def test_reasons_are_counted_most_common_first_and_per_model():
    refused = "connection refused on GET /health"
    workers = [
        Worker("ejected", refused, ("a",)),
        Worker("ejected", UNAUTHORIZED),
        Worker("ejected", refused, ("a",)),
        Worker("healthy", None, ("b",)),
    ]
    assert unroutable(workers, readmit_after_s=2.5, model="a").message == (
        f"no engine for model `a` is routable (0 of 3): 2 ejected after {refused}; 1 ejected after {UNAUTHORIZED}"
    )
    assert unroutable(workers, readmit_after_s=2.5, model="a").retry_after_s == 3
    assert unroutable([], readmit_after_s=10.0).message == "no engine has been discovered yet; retry shortly"


def test_a_full_engine_queue_is_a_429_with_retry_after_direct_and_through_the_router(tok):
    with engines(tok, 1) as (fakes, urls), router(urls) as r:
        fakes[0].fail_with = QUEUE_FULL
        for url in (urls[0], r):
            resp = httpx.post(url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
            assert_error(resp, 429, "too many queued requests")
            assert resp.headers["retry-after"] == "1"


def test_an_engine_503_relayed_by_the_router_carries_retry_after(tok):
    with engines(tok, 1) as (fakes, urls), router(urls, eject_after_failures=100) as r:
        fakes[0].fail_with = InvalidRequestError("engine is not ready or is shutting down", status_code=503)
        resp = httpx.post(r + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}})
        assert_error(resp, 503, "shutting down")
        assert resp.headers["retry-after"] == "1"


def test_the_engines_health_503_carries_retry_after(tok):
    from fake_engine import FakeEngine, ServerThread

    engine = FakeEngine(tok)
    engine.healthy = False
    with ServerThread(engine_app(engine, manage_engine=False)) as url:
        resp = httpx.get(url + "/health")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"


def test_a_429_from_an_engine_without_retry_after_gets_one_from_the_router():
    # Not every OpenAI-compatible engine says when to retry; the router's 429s and 503s always do.
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from fake_engine import ServerThread

    async def models(request: Any) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def busy(request: Any) -> JSONResponse:
        return JSONResponse({"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": 429}}, 429)

    routes = [
        Route("/health", lambda request: Response()),
        Route("/v1/models", models),
        Route("/get_tokenizer_files", lambda request: Response(status_code=404)),
        Route("/v1/completions", busy, methods=["POST"]),
    ]
    with ServerThread(Starlette(routes=routes)) as url, router([url]) as r:
        resp = httpx.post(r + "/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
