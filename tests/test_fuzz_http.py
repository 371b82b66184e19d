"""Fuzzing the HTTP surface in-process: the engine's HTTP layer over the FakeEngine, and the router in front of one.

Schemathesis walks each app's ``GET /openapi.json`` (schema-valid and schema-violating requests to every operation);
hypothesis sends the generation endpoints hostile bodies (tests/fuzz_inputs.py). Every answer must be a 2xx or the
OpenAI error body with the right status (never a 5xx but 503, never FastAPI's 422), within ``TIMEOUT_S``, and the
server answers a normal request correctly afterwards. Budget: ``RADIXSERVE_FUZZ_EXAMPLES`` (fuzz_inputs.py).
tests/test_fuzz_tiny_engine.py does the same against a real engine process on the tiny model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from radixserve.contracts.edge import valid_request_id
from radixserve.contracts.protocol import ChatCompletionRequest, CompletionRequest, GenerateReqInput
from radixserve.contracts.sse import sse
from radixserve.engine.server.http import create_app as engine_app
from radixserve.router.app import create_app as router_app
from radixserve.router.config import RouterArgs
from radixserve.router.request import output_token_cost

from fake_engine import FakeEngine, ServerThread, load_tokenizer, wait_until
from fuzz_inputs import (
    ENDPOINTS,
    EXAMPLES,
    FUZZ_SETTINGS,
    VALID,
    AsgiClient,
    check,
    encode,
    fuzz_schema,
    mutated_body,
    raw_request,
    still_serves,
)


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


@pytest.fixture(scope="module")
def portal() -> Iterator[BlockingPortal]:
    with start_blocking_portal() as p:
        yield p


@pytest.fixture(scope="module")
def engine_client(tok: Any, portal: BlockingPortal) -> AsgiClient:
    return AsgiClient(portal, engine_app(FakeEngine(tok), manage_engine=False))


@pytest.fixture(scope="module")
def router_client(tok: Any, portal: BlockingPortal) -> Iterator[AsgiClient]:
    """The router app in-process (its lifespan running) in front of a fake engine served by uvicorn."""
    with ServerThread(engine_app(FakeEngine(tok), manage_engine=False)) as url:
        app = router_app(RouterArgs(worker_urls=[url], health_interval_s=0.5))
        with portal.wrap_async_context_manager(app.router.lifespan_context(app)):
            client = AsgiClient(portal, app)
            assert wait_until(lambda: client.request("GET", "/ready").status_code == 200, 30)
            yield client


@pytest.fixture(params=["engine", "router"])
def server(request: pytest.FixtureRequest) -> AsgiClient:
    return request.getfixturevalue(f"{request.param}_client")  # type: ignore[no-any-return]


# ---- the OpenAPI schemas


@pytest.mark.parametrize("which", ["engine", "router"])
def test_openapi_schema_describes_the_generation_routes(which: str, request: pytest.FixtureRequest) -> None:
    client: AsgiClient = request.getfixturevalue(f"{which}_client")
    schema = client.request("GET", "/openapi.json").json()
    for path in ENDPOINTS:
        op = schema["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].startswith("#/components/schemas/")
        assert "422" not in op["responses"]  # bad input is a 400 with the OpenAI error body
        assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"
        }


def test_schemathesis(server: AsgiClient) -> None:
    """Every operation of the app's own schema, with schema-valid and schema-violating inputs."""
    fuzz_schema(server, EXAMPLES)
    still_serves(server)


# ---- hostile bodies


@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzz_odd_fields(server: AsgiClient, path: str) -> None:
    @FUZZ_SETTINGS
    @given(body=mutated_body(path))
    def run(body: dict[str, Any]) -> None:
        check(server.post_json(path, body), f"POST {path} {encode(body)[:2000]!r}")

    run()
    still_serves(server)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzz_raw_bodies(server: AsgiClient, path: str) -> None:
    @FUZZ_SETTINGS
    @given(req=raw_request(path))
    def run(req: tuple[bytes, dict[str, str]]) -> None:
        raw, headers = req
        resp = server.request("POST", path, raw, headers)
        check(resp, f"POST {path} {headers} {raw[:2000]!r}")

    run()
    still_serves(server)


def test_fuzz_other_methods_and_paths(server: AsgiClient) -> None:
    @FUZZ_SETTINGS
    @given(
        method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST"]),
        path=st.sampled_from([*ENDPOINTS, "/v1/models/x", "/nope", "/v1/models/%00", "/generate/x"]),
    )
    def run(method: str, path: str) -> None:
        resp = server.request(method, path, b"{}", {"content-type": "application/json"})
        if resp.status_code < 300:
            return
        check(resp, f"{method} {path}")

    run()
    still_serves(server)


def test_fuzz_headers(server: AsgiClient) -> None:
    """Odd ``x-request-id`` (echoed only when printable ASCII of at most 128 characters), ``authorization`` and
    ``accept`` values on a normal request: still answered, the id header always valid."""
    latin1 = st.text(st.characters(min_codepoint=0, max_codepoint=255, exclude_characters="\r\n"), max_size=200)

    @FUZZ_SETTINGS
    @given(rid=latin1, auth=latin1, accept=latin1, path=st.sampled_from(ENDPOINTS))
    def run(rid: str, auth: str, accept: str, path: str) -> None:
        headers = {"content-type": "application/json", "x-request-id": rid, "authorization": auth, "accept": accept}
        enc = {k: v.encode("latin-1") for k, v in headers.items()}
        resp = server.portal.call(lambda: server.http.post(path, content=encode(VALID[path]), headers=enc))
        check(resp, f"POST {path} {headers!r}")
        echoed = resp.headers["x-request-id"]
        assert echoed == rid if valid_request_id(rid) else len(echoed) == 32, (rid, echoed)

    run()


def test_body_over_the_limit_is_a_413(server: AsgiClient) -> None:
    """8 MiB + 1 byte (the default --max-request-body-bytes), with and without a Content-Length: the error body."""
    raw = b'{"prompt": "' + b"a" * (8 * 1024 * 1024) + b'"}'
    resp = server.request("POST", "/v1/completions", raw, {"content-type": "application/json"})
    check(resp, "8 MiB body")
    assert resp.status_code == 413, resp.text

    async def chunks() -> Any:
        for _ in range(9):
            yield b"a" * (1024 * 1024)

    resp = server.portal.call(lambda: server.http.post("/generate", content=chunks()))
    check(resp, "8 MiB chunked body")
    assert resp.status_code == 413, resp.text


# ---- regressions: the exact inputs the fuzzing found


def test_router_n_too_large_for_a_float_is_a_400(router_client: AsgiClient) -> None:
    # "n": 10**400 (a JSON integer of 401 digits) made the router's output-token cost overflow the policy's float
    # load arithmetic: OverflowError, a 500. Now the engine's 400 passes through.
    huge = b"1" + b"0" * 400
    for path, raw in [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "n": %s}'),
        ("/v1/completions", b'{"model": "smollm2-135m-instruct", "prompt": "Once upon", "max_tokens": 4, "n": %s}'),
        ("/generate", b'{"text": "Once upon", "sampling_params": {"max_new_tokens": 4, "n": %s}}'),
        ("/v1/completions", b'{"prompt": "Once upon", "max_tokens": %s}'),
    ]:
        resp = router_client.request("POST", path, raw % huge, {"content-type": "application/json"})
        check(resp, path)
        assert resp.status_code == 400, resp.text
    assert output_token_cost("completions", {"n": 10**400, "max_tokens": 4}, 16) == 4
    assert output_token_cost("generate", {"sampling_params": {"max_new_tokens": 10**400}}, 16) == 16


def test_an_integer_over_4300_digits_is_a_400(server: AsgiClient) -> None:
    # New-user try: Python's json.loads refuses integers of over 4,300 digits with a plain ValueError, which the body
    # parser did not catch: a 500 on the engine and the router, in any field (an ignored one such as metadata too).
    huge = b"1" + b"0" * 5000
    for path, raw in [
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": %s}'),
        ("/v1/completions", b'{"prompt": "a", "max_tokens": 2, "metadata": {"a": %s}}'),
        ("/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": %s}}'),
    ]:
        resp = server.request("POST", path, raw % huge, {"content-type": "application/json"})
        check(resp, path)
        assert resp.status_code == 400, resp.text
        assert "integer too long" in resp.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_generate_rid_with_a_lone_surrogate_is_a_400(server: AsgiClient, stream: bool) -> None:
    # meta_info.id echoes the rid: "\ud800" could not be written as UTF-8, a 500 (engine and router).
    s = b"true" if stream else b"false"
    for raw, param in [
        (b'{"text": "a", "rid": "\\ud800", "stream": %s, "sampling_params": {"max_new_tokens": 2}}' % s, "rid"),
        (b'{"text": ["a", "b"], "rid": ["ok", "x\\udfffy"], "stream": %s}' % s, "rid[1]"),
    ]:
        resp = server.request("POST", "/generate", raw, {"content-type": "application/json"})
        check(resp, raw.decode())
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_unknown_model_with_a_lone_surrogate_is_a_404(server: AsgiClient) -> None:
    # The 404 quotes the model: "\ud800" could not be written as UTF-8, a 500 (engine).
    for path, raw in [
        (
            "/v1/chat/completions",
            b'{"model": "\\ud800", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}',
        ),
        ("/v1/completions", b'{"model": "a\\udfff", "prompt": "Once upon", "max_tokens": 4, "stream": true}'),
    ]:
        resp = server.request("POST", path, raw, {"content-type": "application/json"})
        check(resp, raw.decode())
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "model", resp.text
    assert (
        "\ud800"
        in server.post_json("/v1/chat/completions", {"model": "\ud800", "messages": []}).json()["error"]["message"]
    )


def test_sse_writes_a_lone_surrogate_as_its_escape() -> None:
    # Defence in depth: a stream event that cannot be UTF-8 is sent escaped, never an exception mid-stream.
    assert sse({"text": "a\ud800"}) == b'data: {"text":"a\\ud800"}\n\n'
    assert sse({"text": "é"}) == 'data: {"text":"é"}\n\n'.encode()


# ---- huge arrays of bad elements

_HUGE = 1_000  # enough to tell "every element" from "the first few"
_HUGE_ARRAYS = [
    (GenerateReqInput, {"text": "x", "sampling_params": [0] * _HUGE}),
    (GenerateReqInput, {"input_ids": [1.5] * _HUGE}),
    (ChatCompletionRequest, {"messages": [0] * _HUGE}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "tool_calls": [0] * _HUGE}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": ["a"] * _HUGE}),
    (CompletionRequest, {"prompt": [1.5] * _HUGE}),
]


@pytest.mark.parametrize(("model", "body"), _HUGE_ARRAYS, ids=lambda x: getattr(x, "__name__", ""))
def test_huge_array_of_bad_elements_reports_few_errors(model: type[BaseModel], body: dict[str, Any]) -> None:
    # Regression: a list field reported every bad element, and FastAPI then built one error dict per element on the
    # event loop (an 8 MB /generate body with sampling_params [0, 0, ...] of 4M entries took 60 s to answer its 400,
    # and a GET /v1/models sent meanwhile waited 33 s). The request lists now stop at their first bad element.
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    assert e.value.error_count() <= 10
