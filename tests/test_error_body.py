"""Issue 11, item 9: one OpenAI error body, ``{"error": {"message", "type", "param", "code"}}``, for HTTP answers
and streamed errors, from the engine and the router alike, and the official ``openai`` client reads it.

Real engine HTTP layers over a scripted fake engine (tests/fake_engine.py) and a real router, served by uvicorn."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from radixserve.contracts import constants
from radixserve.engine.io_struct import InvalidRequestError
from radixserve.engine.server.http import create_app as engine_app
from radixserve.router.app import create_app as router_app
from radixserve.router.config import RouterArgs

from fake_engine import FakeEngine, ServerThread, load_tokenizer, sse_payloads, wait_until

MODEL = "smollm2-135m-instruct"
MSGS = [{"role": "user", "content": "Say hello."}]
# Issue 11: this body answered "33: JSON decode error" with param "33" (FastAPI's character offset).
BROKEN_AT_33 = b'{"messages": [{"role": "user"}   {"role": "user"}]}'
STREAM_FAILURE = InvalidRequestError("the grammar rejected token 7", "response_format", 400)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[FakeEngine, str, str]]:
    """(fake engine, engine URL, router URL): one engine behind the real engine HTTP layer, one router in front."""
    engine = FakeEngine(load_tokenizer())
    with contextlib.ExitStack() as stack:
        engine_url = stack.enter_context(ServerThread(engine_app(engine, manage_engine=False)))
        args = RouterArgs(worker_urls=[engine_url], health_interval_s=0.5)
        router_url = stack.enter_context(ServerThread(router_app(args)))
        assert wait_until(lambda: httpx.get(router_url + "/health").json()["routable_workers"] == 1, 30)
        yield engine, engine_url, router_url


@pytest.fixture(autouse=True)
def _reset(stack: tuple[FakeEngine, str, str]) -> Iterator[None]:
    yield
    stack[0].fail_after_first = None


def oai(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def urls(stack: tuple[FakeEngine, str, str]) -> list[str]:
    return [stack[1], stack[2]]


@pytest.mark.parametrize("via", ["engine", "router"])
def test_http_error_is_a_bad_request_error_with_our_fields(stack, via):
    url = dict(zip(["engine", "router"], urls(stack)))[via]
    with pytest.raises(openai.BadRequestError) as info:
        oai(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 5}])  # type: ignore[misc]
    e = info.value
    expected = "messages[0].content: Input should be a valid string or Input should be a valid list"
    assert e.status_code == 400 and e.body == {
        "message": expected,
        "type": "invalid_request_error",
        "param": "messages[0].content",
        "code": 400,
    }
    assert expected in e.message and e.type == "invalid_request_error"
    assert e.param == "messages[0].content" and e.code == "400"  # the SDK makes code a string
    assert set(e.response.json()) == {"error"}  # no top-level "object": the flat body is gone


@pytest.mark.parametrize("via", ["engine", "router"])
def test_streamed_error_is_an_api_error_with_our_fields(stack, via):
    engine = stack[0]
    engine.fail_after_first = STREAM_FAILURE
    url = dict(zip(["engine", "router"], urls(stack)))[via]
    stream = oai(url).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, stream=True)
    got = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            got.append(chunk)
    e = info.value
    assert not isinstance(e, openai.APIStatusError)  # the answer was a 200; the error came in the stream
    assert got, "the error came before any chunk"
    assert e.message == "the grammar rejected token 7" and e.type == "invalid_request_error"
    assert e.param == "response_format" and e.code == "400"
    # The event is the HTTP error body itself, not {"error": <flat body>}.
    engine.fail_after_first = STREAM_FAILURE
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "stream": True}, timeout=30)
    assert r.status_code == 200
    assert sse_payloads(r.text)[-1] == {
        "error": {
            "message": "the grammar rejected token 7",
            "type": "invalid_request_error",
            "param": "response_format",
            "code": 400,
        }
    }


def test_router_errors_are_status_errors_too(stack):
    _, _, router = stack
    with pytest.raises(openai.NotFoundError) as info:
        oai(router).chat.completions.create(model="no-such-model", messages=MSGS)
    assert info.value.param == "model" and info.value.code == "404" and info.value.type == "not_found_error"
    assert "The model `no-such-model` does not exist." in info.value.message


@pytest.mark.parametrize("via", ["engine", "router"])
def test_authentication_error(via):
    engine = FakeEngine(load_tokenizer(), api_key="sekret")
    with ServerThread(engine_app(engine, manage_engine=False)) as url:
        if via == "router":
            ctx: Any = ServerThread(
                router_app(RouterArgs(worker_urls=[url], api_key="sekret", engine_api_key="sekret"))
            )
        else:
            ctx = contextlib.nullcontext(url)
        with ctx as target, pytest.raises(openai.AuthenticationError) as info:
            oai(target, key="wrong").chat.completions.create(model=MODEL, messages=MSGS)
    assert info.value.code == "401" and info.value.type == constants.ERROR_TYPES[401] and info.value.param is None


def test_bad_json_gets_the_same_readable_body_from_engine_and_router(stack):
    answers = [
        httpx.post(url + path, content=BROKEN_AT_33, headers={"content-type": "application/json"})
        for url in urls(stack)
        for path in ("/v1/chat/completions", "/generate")
    ]
    expected = {
        "error": {
            "message": "the request body is not valid JSON at line 1 column 34: Expecting ',' delimiter",
            "type": "invalid_request_error",
            "param": None,
            "code": 400,
        }
    }
    assert [(r.status_code, r.json()) for r in answers] == [(400, expected)] * 4


@pytest.mark.parametrize(
    "body",
    [b"", b"[1, 2]", b'{"text": "\xff"}', b'{"text": "a",\n "stream": tru}', b"[" * 100_000],
)
def test_engine_and_router_word_a_body_that_is_not_an_object_alike(stack, body):
    engine_r, router_r = (
        httpx.post(url + "/generate", content=body, headers={"content-type": "application/json"}) for url in urls(stack)
    )
    assert engine_r.status_code == router_r.status_code == 400
    assert engine_r.json() == router_r.json() and engine_r.json()["error"]["param"] is None


@pytest.mark.parametrize("via", ["engine", "router"])
def test_a_405_has_an_openai_type(stack, via):
    """Issue 11 round 2, item 12: GET on a POST route answered ``"type": "error"``."""
    url = dict(zip(["engine", "router"], urls(stack)))[via]
    r = httpx.get(url + "/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json() == {
        "error": {"message": "Method Not Allowed", "type": "invalid_request_error", "param": None, "code": 405}
    }


def test_server_side_errors_are_server_errors(stack):
    """A 503 (engine: not ready; router: no engine routable) is OpenAI's ``server_error``, raised by the SDK as
    InternalServerError (it said ``service_unavailable``)."""
    engine, engine_url, _ = stack
    engine.fail_with = InvalidRequestError("engine is not ready or is shutting down", None, 503)
    try:
        with pytest.raises(openai.InternalServerError) as info:
            oai(engine_url).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    finally:
        engine.fail_with = None
    assert info.value.status_code == 503 and info.value.type == "server_error" and info.value.code == "503"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused
    with ServerThread(router_app(RouterArgs(worker_urls=[dead], health_interval_s=0.5))) as router:
        with pytest.raises(openai.InternalServerError) as info:
            oai(router).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    assert info.value.status_code == 503 and info.value.type == "server_error"
