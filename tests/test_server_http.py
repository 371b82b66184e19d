"""Operational routes and HTTP edge behaviour of the engine server over a fake engine (tests/fake_engine.py):
health, models, metrics, errors, request ids, body limit, API key, lifespan, client disconnects."""

import httpx
import pytest
from fastapi.testclient import TestClient

from radixserve.engine.server.context import RidRegistry
from radixserve.engine.server.http import create_app

from fake_engine import FakeEngine, ServerThread, client, engine, tokenizer, wait_until  # noqa: F401 - shared pytest fixtures

MSGS = [{"role": "user", "content": "Say hello."}]


def test_health(client, engine):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    engine.healthy = False
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    assert client.get("/health_generate").status_code == 503


def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == "smollm2-135m-instruct" and card["object"] == "model" and card["max_model_len"] == 2048
    assert client.get("/v1/models/smollm2-135m-instruct").json()["id"] == card["id"]
    r = client.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_model_info_flush_metrics_abort(client, engine):
    assert client.get("/get_model_info").json()["context_length"] == 2048
    assert client.post("/flush_cache").status_code == 200
    engine.running.add("busy")
    assert client.post("/flush_cache").status_code == 400
    engine.metrics.num_running_reqs.set(3)
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'radixserve_engine_num_running_reqs{model_name="smollm2-135m-instruct"} 3.0' in r.text
    assert client.post("/abort_request", json={"rid": "r9"}).status_code == 200
    assert engine.aborted_by_call == ["r9"]


def test_unknown_route_is_openai_error(client):
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


# Issue 11: this body answered "33: JSON decode error" with param "33" (FastAPI's character offset).
BROKEN_AT_33 = b'{"messages": [{"role": "user"}   {"role": "user"}]}'
NOT_AN_OBJECT = [
    (BROKEN_AT_33, "the request body is not valid JSON at line 1 column 34: Expecting ',' delimiter"),
    (
        b"{bad json",
        "the request body is not valid JSON at line 1 column 2: Expecting property name enclosed in double quotes",
    ),
    (b'{"text": "a",\n "stream": tru}', "the request body is not valid JSON at line 2 column 12: Expecting value"),
    (b"", "the request body is empty; a JSON object is expected"),
    (b"[1, 2]", "the request body must be a JSON object"),
    (b'{"text": "\xff"}', "the request body is not valid UTF-8 (byte 10): a JSON object is expected"),
    (b"[" * 100_000, "the request body nests JSON too deeply"),
]


@pytest.mark.parametrize(("body", "message"), NOT_AN_OBJECT)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
def test_a_body_that_is_not_a_json_object_is_a_clear_400(client, path, body, message):
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 400}}


def test_a_json_object_without_the_json_content_type_says_so(client):
    # `curl -d '{...}'` sends application/x-www-form-urlencoded; FastAPI does not read such a body as JSON.
    for headers in ({"content-type": "application/x-www-form-urlencoded"}, {"content-type": "text/plain"}):
        r = client.post("/generate", content=b'{"text": "a"}', headers=headers)
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "the request body must be sent with Content-Type: application/json",
            "type": "invalid_request_error",
            "param": None,
            "code": 400,
        }


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        # pydantic's loc is ("body", "messages", 0, "content", "str"): the union member tag is not a field
        (
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
            "messages[0].content: Input should be a valid string or Input should be a valid list",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]},
            "messages[0].content",
            "messages[0].content: Input should be a valid string; messages[0].content[0].text: Input should be a",
        ),
        ({"messages": MSGS, "max_tokens": "many"}, "max_tokens", "max_tokens: Input should be a valid integer"),
        ({"messages": MSGS, "stream_options": {"include_usage": "x"}}, "stream_options.include_usage", "boolean"),
    ],
)
def test_a_field_error_names_the_field_path_in_param(client, body, param, message):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400
    assert message in error["message"]


def test_request_id_generated_and_echoed_everywhere(client):
    r = client.get("/health")
    rid = r.headers["x-request-id"]
    assert len(rid) == 32 and int(rid, 16) >= 0
    assert client.get("/health").headers["x-request-id"] != rid
    for resp in (
        client.get("/health", headers={"x-request-id": "abc-1"}),
        client.post("/v1/chat/completions", json={"messages": []}, headers={"x-request-id": "abc-1"}),
        client.post("/v1/chat/completions", json={"model": "x", "messages": MSGS}, headers={"x-request-id": "abc-1"}),
        client.post("/v1/chat/completions", json={"messages": MSGS, "stream": True}, headers={"x-request-id": "abc-1"}),
    ):
        assert resp.headers["x-request-id"] == "abc-1"
    bad = client.get("/health", headers={"x-request-id": "x" * 500})
    assert len(bad.headers["x-request-id"]) == 32


def test_rid_registry_never_hands_out_a_live_rid():
    reg = RidRegistry()
    (a,) = reg.claim("r", 1)
    (b,) = reg.claim("r", 1)
    assert a == "r" and b != a and b.startswith("r-")
    many = reg.claim("r", 3)
    assert many == ["r-0", "r-1", "r-2"]
    reg.release([a])
    assert reg.claim("r", 1) == ["r"]


def test_body_limit(tokenizer):
    engine = FakeEngine(tokenizer, max_request_body_bytes=1000)
    client = TestClient(create_app(engine, manage_engine=False))
    big = {"messages": [{"role": "user", "content": "x" * 2000}]}
    r = client.post("/v1/chat/completions", json=big, headers={"x-request-id": "big"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers["x-request-id"] == "big"

    def chunked():  # no Content-Length: the limit must hold on the body actually read
        for _ in range(5):
            yield b"x" * 300

    r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert client.post("/v1/chat/completions", json={"messages": MSGS}).status_code == 200
    assert len(engine.requests) == 1


def test_api_key(tokenizer):
    engine = FakeEngine(tokenizer, api_key="sekret")
    client = TestClient(create_app(engine, manage_engine=False))
    r = client.post("/v1/chat/completions", json={"messages": MSGS})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = client.post("/v1/chat/completions", json={"messages": MSGS}, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "bearer sekret"}).status_code == 200  # any case
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_unexpected_exception_is_500_without_traceback(client, engine):
    engine.fail_with = ZeroDivisionError("secret internals")  # type: ignore[assignment]
    for path, body in (("/v1/chat/completions", {"messages": MSGS}), ("/generate", {"text": "a"})):
        r = client.post(path, json=body, headers={"x-request-id": "e500"})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error"
        assert "secret" not in r.text and "Traceback" not in r.text
        assert r.headers["x-request-id"] == "e500"


def test_lifespan_starts_and_stops_the_engine(engine):
    app = create_app(engine)
    with TestClient(app) as c:
        assert wait_until(lambda: engine.started)
        assert c.get("/health").status_code == 200
    assert engine.stopped


@pytest.mark.timeout(120)
def test_client_disconnect_aborts_generation(tokenizer):
    engine = FakeEngine(tokenizer, delay_s=0.2)
    with ServerThread(create_app(engine, manage_engine=False)) as url:
        # Streaming: read the first chunk, then drop the connection.
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream(
                "POST",
                "/v1/chat/completions",
                json={"messages": MSGS, "stream": True, "max_tokens": 1000},
                headers={"x-request-id": "s1"},
            ) as r:
                assert r.status_code == 200
                next(r.iter_lines())
        assert wait_until(lambda: "s1" in engine.aborted), engine.aborted
        # Non-streaming: the client times out and closes the connection.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                url + "/v1/completions",
                json={"prompt": "hi", "max_tokens": 1000},
                headers={"x-request-id": "n1"},
                timeout=0.5,
            )
        assert wait_until(lambda: "n1" in engine.aborted), engine.aborted
        assert wait_until(lambda: not engine.running)
        # Finished requests are not counted as aborted, and the server still serves.
        body = {"messages": MSGS, "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": "ok"})
        assert r.status_code == 200 and "ok" not in engine.aborted


def test_tokenizer_files_rebuild_the_same_tokenizer(client, tokenizer, tmp_path):
    """A router rebuilds the engine's tokenizer (and chat template) from /get_tokenizer_files alone."""
    from transformers import AutoTokenizer

    resp = client.get("/get_tokenizer_files")
    assert resp.status_code == 200
    body = resp.json()
    assert body["model"] == "smollm2-135m-instruct"
    assert "tokenizer.json" in body["files"]
    for name, text in body["files"].items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    rebuilt = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "Hello there! Ünïcödé café, 日本語 🙂"
    assert rebuilt.encode(text) == tokenizer.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert rebuilt.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
