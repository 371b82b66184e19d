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

from fuzz_inputs import (
    ENDPOINTS,
    EXAMPLES,
    FUZZ_SETTINGS,
    AsgiClient,
    check,
    encode,
    fuzz_schema,
    mutated_body,
    raw_request,
    still_serves,
)
from radixserve.contracts.sse import sse
from radixserve.engine.server.http import create_app as engine_app
from radixserve.router.app import create_app as router_app
from radixserve.router.config import RouterArgs
from radixserve.router.request import output_token_cost

from fake_engine import FakeEngine, ServerThread, load_tokenizer, wait_until


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


def test_sse_writes_a_lone_surrogate_as_its_escape() -> None:
    # Defence in depth: a stream event that cannot be UTF-8 is sent escaped, never an exception mid-stream.
    assert sse({"text": "a\ud800"}) == b'data: {"text":"a\\ud800"}\n\n'
    assert sse({"text": "é"}) == 'data: {"text":"é"}\n\n'.encode()
