"""router/request.py: each proxied request parsed once, with the engine's errors for what it would refuse."""

from __future__ import annotations

import json

import pytest

from radixserve.contracts.json_body import CONTENT_TYPE_MESSAGE
from radixserve.router.request import ProxiedRequest, RequestError, output_token_cost, parse_request

JSON = "application/json"
ONE = frozenset({"m"})


def parse(body: object, kind: str = "chat", ctype: str | None = JSON, served: frozenset[str] = ONE) -> object:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(kind, raw, ctype, served, 100)  # type: ignore[arg-type]


def test_not_a_json_object_is_the_engines_400():
    for raw in (b"[1, 2]", b"{not json", b'"text"'):
        got = parse(raw)
        assert isinstance(got, RequestError) and got.status == 400 and got.param is None


def test_a_json_object_without_a_json_content_type_is_refused():
    got = parse({"messages": []}, ctype="application/x-www-form-urlencoded")
    assert got == RequestError(400, CONTENT_TYPE_MESSAGE)


@pytest.mark.parametrize(
    ("model", "served", "status"),
    [(7, ONE, 400), ("other", ONE, 404), (None, frozenset({"a", "b"}), 400), (None, frozenset(), 503)],
)
def test_model_errors(model, served, status):
    got = parse({"model": model, "messages": []}, served=served)
    assert isinstance(got, RequestError) and got.status == status
    if status != 503:
        assert got.param == "model" and got.message


def test_the_only_served_model_is_the_default():
    got = parse({"messages": [{"role": "user", "content": "hi"}]})
    assert isinstance(got, ProxiedRequest) and got.model == "m" and not got.stream


@pytest.mark.parametrize("off", [False, None])  # null is its default (new-user try: the engine answered 400)
def test_an_openai_stream_asks_for_usage_without_touching_the_clients_body(off):
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": off}}
    got = parse(body)
    assert isinstance(got, ProxiedRequest) and got.strip_usage and got.stream
    assert json.loads(got.content)["stream_options"] == {"include_usage": True}
    assert got.body["stream_options"] == {"include_usage": off}  # what the extractor reads is the client's


@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": "false"}, {"include_usage": 0}, "yes"])
def test_stream_options_the_router_does_not_rewrite(options):
    body = {"model": "m", "prompt": "x", "stream": True, "stream_options": options}
    raw = json.dumps(body).encode()
    got = parse_request("completions", raw, JSON, ONE, 100)
    assert isinstance(got, ProxiedRequest) and got.content == raw and not got.strip_usage


def test_native_streams_carry_cached_tokens_in_every_chunk_so_are_sent_as_is():
    raw = json.dumps({"text": "x", "stream": True}).encode()
    got = parse_request("generate", raw, JSON, ONE, 100)
    assert isinstance(got, ProxiedRequest) and got.content == raw and not got.strip_usage


def test_a_lone_surrogate_reaches_the_engine_as_its_escape():
    raw = b'{"model": "m", "prompt": "\\ud800", "stream": true}'
    got = parse_request("completions", raw, JSON, ONE, 100)
    assert isinstance(got, ProxiedRequest) and b"\\ud800" in got.content


@pytest.mark.parametrize(
    ("kind", "body", "cost"),
    [
        ("chat", {"max_tokens": 10, "max_completion_tokens": 4, "n": 3}, 12),
        ("chat", {"max_tokens": 10}, 10),
        ("chat", {"max_tokens": True, "n": False}, 100),
        ("completions", {"max_tokens": -1, "n": 2}, 200),
        ("completions", {"max_tokens": 4, "n": 2, "best_of": 5}, 20),  # regression: counted n, not best_of
        ("completions", {"max_tokens": 4, "n": 2, "best_of": 10**400}, 8),  # malformed: the engine's 400
        ("generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 5, "n": 2}}, 20),
        ("generate", {"input_ids": [[1], [2], [3]], "sampling_params": [{"max_new_tokens": 2}]}, 6),
        ("generate", {"text": "a", "sampling_params": "bad"}, 100),
    ],
)
def test_output_token_cost(kind, body, cost):
    assert output_token_cost(kind, body, 100) == cost
