"""The OpenAI endpoints over a fake engine (tests/fake_engine.py): shapes, validation, streaming, logprobs."""

import pytest
from fastapi.testclient import TestClient

from radixserve.contracts import constants
from radixserve.engine.server.http import create_app

from fake_engine import FakeEngine, client, engine, sse_payloads, tokenizer  # noqa: F401 - shared pytest fixtures

MODEL = "smollm2-135m-instruct"
MSGS = [{"role": "user", "content": "Say hello."}]


def chat_ids(tokenizer, messages):
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


def assert_error(r, status, *needles):
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(r.json()) == {"error"}
    assert body["code"] == status
    assert body["type"] == constants.ERROR_TYPES[status]
    for needle in needles:
        assert needle in body["message"], body["message"]
    return body


# ------------------------------------------------------------------------------------------------------------ chat


def test_chat_basic(client, engine, tokenizer):
    engine.cached_tokens = 7
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": MSGS, "max_tokens": 4, "temperature": 0, "seed": 3},
        headers={"x-request-id": "req-abc"},
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "req-abc"
    body = r.json()
    ids = chat_ids(tokenizer, MSGS)
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-req-abc" and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode(engine.script_ids[:4])}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 4,
        "total_tokens": len(ids) + 4,
        "prompt_tokens_details": {"cached_tokens": 7},
    }
    (greq,) = engine.requests
    assert greq.rid == "req-abc" and greq.input_ids == ids
    assert greq.sampling_params.temperature == 0 and greq.sampling_params.seed == 3
    assert greq.sampling_params.max_new_tokens == 4


def test_chat_finish_stop_when_script_ends(client, engine):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1000})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == len(engine.script_ids)


@pytest.mark.parametrize("extra", [{}, {"max_tokens": None}, {"max_completion_tokens": None}])
def test_chat_max_tokens_default_is_room_left(client, engine, tokenizer, extra):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, **extra})
    assert r.status_code == 200
    assert engine.requests[0].sampling_params.max_new_tokens == 2048 - len(chat_ids(tokenizer, MSGS))


def test_chat_max_completion_tokens_wins(client, engine):
    client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 9, "max_completion_tokens": 3})
    assert engine.requests[0].sampling_params.max_new_tokens == 3


def test_chat_n_samples(client, engine):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "n": 3, "max_tokens": 3})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["message"]["content"] for c in choices}) == 3
    assert r.json()["usage"]["completion_tokens"] == 9
    assert len(engine.requests) == 1 and engine.requests[0].sampling_params.n == 3


def test_chat_stop_and_extras_reach_engine(client, engine):
    client.post(
        "/v1/chat/completions",
        json={"messages": MSGS, "stop": "Observation", "top_k": 5, "min_p": 0.1, "stop_token_ids": [7], "user": "u"},
    )
    sp = engine.requests[0].sampling_params
    assert sp.stop == ["Observation"] and sp.top_k == 5 and sp.min_p == 0.1 and sp.stop_token_ids == [7]


def test_chat_text_parts_are_flattened(client, engine, tokenizer):
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200
    assert engine.requests[0].input_ids == chat_ids(tokenizer, [{"role": "user", "content": "Say\nhello."}])


def test_chat_tools_with_choice_none_are_ignored(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": tools, "tool_choice": "none"})
    assert r.status_code == 200


@pytest.mark.parametrize(
    "patch, status, needle",
    [
        ({"model": "gpt-4"}, 404, "gpt-4"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "image"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            400,
            "response_format.json_schema",
        ),
        ({"response_format": {"type": "yaml"}}, 400, "response_format.type"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            400,
            "unknown tool",
        ),
        ({"tools": [{"type": "retrieval"}]}, 400, "function tool"),
        ({"tool_choice": "required"}, 400, "no tools"),
        ({"regex": "a+", "response_format": {"type": "json_object"}}, 400, "one output constraint"),
        ({"top_logprobs": 2}, 400, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "20"),
        ({"max_tokens": -1}, 400, "max_tokens"),
        ({"temperature": "hot"}, 400, "temperature"),
        ({"temperature": -1}, 400, "temperature"),
        ({"n": 0}, 400, "n"),
        ({"logit_bias": {"one": 5}}, 400, "logit_bias"),  # honoured since issue 16; a bad key is a 400
        ({"stream_options": {"include_usage": True}}, 400, "stream"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_invalid_requests(client, engine, patch, status, needle, stream):
    body = {"messages": MSGS, **patch}
    if stream and "stream_options" not in patch:
        body["stream"] = True
    r = client.post("/v1/chat/completions", json=body)
    assert_error(r, status, needle)
    assert engine.requests == []


def test_validation_errors_are_400_not_422(client):
    assert_error(client.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages")
    assert_error(client.post("/v1/chat/completions", content=b"{not json"), 400)
    assert_error(client.post("/v1/completions", json={"prompt": [1, "a"]}), 400)


def test_chat_prompt_over_context_length(tokenizer):
    engine = FakeEngine(tokenizer, context_length=64)
    client = TestClient(create_app(engine, manage_engine=False))
    long = [{"role": "user", "content": "word " * 100}]
    p = len(chat_ids(tokenizer, long))
    body = assert_error(client.post("/v1/chat/completions", json={"messages": long, "stream": True}), 400)
    assert str(p) in body["message"] and "64" in body["message"]
    p = len(chat_ids(tokenizer, MSGS))
    body = assert_error(client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 64}), 400)
    for number in (64, p, 64 + p):
        assert str(number) in body["message"]
    ok = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 64 - p})
    assert ok.status_code == 200
    assert engine.requests[-1].sampling_params.max_new_tokens == 64 - p


def test_chat_logprobs_without_top(client, engine):
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 6, "logprobs": True})
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 6 == r.json()["usage"]["completion_tokens"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] <= 0 and entry["top_logprobs"] == []
    # Byte-level tokens: the bytes of all entries are exactly the UTF-8 text.
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == choice["message"]["content"]
    assert engine.requests[0].return_logprob and engine.requests[0].top_logprobs_num == 0


def test_chat_top_logprobs(client):
    body = {"messages": MSGS, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    r = client.post("/v1/chat/completions", json=body)
    for entry in r.json()["choices"][0]["logprobs"]["content"]:
        tops = entry["top_logprobs"]
        assert len(tops) == 2
        assert tops[0]["logprob"] >= tops[1]["logprob"]
        assert all(set(t) == {"token", "logprob", "bytes"} for t in tops)


def test_chat_stream(client, engine):
    full = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 12}).json()
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 12, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(r.text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    assert "\ufffd" not in text
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_include_usage_and_n(client):
    r = client.post(
        "/v1/chat/completions",
        json={"messages": MSGS, "max_tokens": 3, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = sse_payloads(r.text)
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_chat_stream_logprobs(client):
    r = client.post(
        "/v1/chat/completions",
        json={"messages": MSGS, "max_tokens": 5, "stream": True, "logprobs": True, "top_logprobs": 1},
    )
    entries = [e for c in sse_payloads(r.text)[1:] for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(entries) == 5 and all(len(e["top_logprobs"]) == 1 for e in entries)


@pytest.mark.parametrize("status", [429, 503])
def test_queue_full_and_shutdown_are_http_errors_when_streaming(client, engine, status):
    from radixserve.engine.io_struct import InvalidRequestError

    engine.fail_with = InvalidRequestError("busy", status_code=status)
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "stream": True})
    assert_error(r, status, "busy")
    r = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert_error(r, status, "busy")


def test_mid_stream_error_is_an_sse_error_event(client, engine):
    engine.fail_after_first = RuntimeError("boom")
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "stream": True, "max_tokens": 5})
    assert r.status_code == 200
    chunks = sse_payloads(r.text)
    assert chunks[-1]["error"]["type"] == "server_error" and chunks[-1]["error"]["code"] == 500
    assert "boom" not in r.text  # no internals leak


def test_engine_abort_is_an_error(client, engine, monkeypatch):
    orig = engine.generate

    async def aborting(req):
        async for out in orig(req):
            out.finish_reason = {"type": "abort", "matched": None, "message": "engine shutting down"}
            yield out
            return

    monkeypatch.setattr(engine, "generate", aborting)
    assert_error(client.post("/v1/chat/completions", json={"messages": MSGS}), 503, "shutting down")


# -------------------------------------------------------------------------------------------------------- completions


def test_completion_prompt_forms(client, engine, tokenizer):
    a, b = tokenizer.encode("one two"), tokenizer.encode("three")
    for prompt, expected in [("one two", [a]), (["one two", "three"], [a, b]), (a, [a]), ([a, b], [a, b])]:
        engine.requests.clear()
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "n": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion"
        assert [g.input_ids for g in engine.requests] == expected
        assert len({g.rid for g in engine.requests}) == len(expected)
        assert [c["index"] for c in body["choices"]] == list(range(2 * len(expected)))
        # Choices are prompt-major: choice 2p + i is sample i of prompt p.
        for c in body["choices"]:
            assert c["text"] == tokenizer.decode(engine.sample_ids(c["index"] % 2)[:2])
        assert body["usage"]["prompt_tokens"] == sum(len(x) for x in expected)
        assert body["usage"]["completion_tokens"] == 4 * len(expected)


@pytest.mark.parametrize("extra", [{}, {"max_tokens": None}])
def test_completion_default_max_tokens_16(client, engine, extra):
    client.post("/v1/completions", json={"prompt": "hi", **extra})
    assert engine.requests[0].sampling_params.max_new_tokens == 16


def test_completion_default_is_clamped_but_explicit_is_checked(tokenizer):
    engine = FakeEngine(tokenizer, context_length=20)
    client = TestClient(create_app(engine, manage_engine=False))
    ids = list(range(100, 110))  # 10 tokens
    assert client.post("/v1/completions", json={"prompt": ids}).status_code == 200
    assert engine.requests[-1].sampling_params.max_new_tokens == 10
    body = assert_error(client.post("/v1/completions", json={"prompt": ids, "max_tokens": 16}), 400)
    assert all(str(x) in body["message"] for x in (20, 10, 16))
    body = assert_error(client.post("/v1/completions", json={"prompt": list(range(100, 120))}), 400)
    assert "20" in body["message"]


def test_completion_echo_max_tokens_zero(client, engine):
    body = {"prompt": "Your answer: Yes", "max_tokens": 0, "echo": True, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    assert choice["text"] == "Your answer: Yes" and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == "Your answer: Yes"
    # The prompt is scored (the engine's prefill): a number for every prompt token but the first.
    assert lp["token_logprobs"][0] is None and all(v is not None for v in lp["token_logprobs"][1:])
    assert [g.logprob_start_len for g in engine.requests] == [0]
    engine.requests.clear()
    body = client.post("/v1/completions", json={"prompt": "Yes", "max_tokens": 0, "echo": True}).json()
    assert body["choices"][0]["text"] == "Yes" and body["choices"][0]["logprobs"] is None
    assert engine.requests == []  # nothing to generate nor to score: no engine round trip


def test_completion_max_tokens_zero_without_echo(client):
    body = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 0}).json()
    assert body["choices"][0]["text"] == "" and body["choices"][0]["finish_reason"] == "length"


def test_completion_legacy_logprobs(client, engine):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "logprobs": 2})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    assert lp["text_offset"][0] == 0
    # Offsets index into the text; a token holding part of a character ("bytes:\\xNN") starts where it does.
    for tok, off in zip(lp["tokens"], lp["text_offset"]):
        assert tok.startswith("bytes:") or choice["text"][off:].startswith(tok)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(choice["text"])
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert v <= 0 and top[tok] == v and 1 <= len(top) <= 3
    assert engine.requests[0].top_logprobs_num == 2


def test_completion_echo_text_offsets_continue_after_prompt(client):
    body = {"prompt": "hi there", "max_tokens": 2, "echo": True, "logprobs": 0}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["text_offset"][0] == 0
    n_prompt = len(lp["tokens"]) - 2
    assert "".join(lp["tokens"][:n_prompt]) == "hi there"
    assert lp["text_offset"][n_prompt] == len("hi there")


@pytest.mark.parametrize(
    "patch, status, needle",
    [
        ({"suffix": "end"}, 400, "suffix"),
        ({"logprobs": 21}, 400, "logprobs"),
        ({"prompt": [5, 10**6]}, 400, "token ids"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": ""}, 400, "empty"),
        ({"max_tokens": -5}, 400, "max_tokens"),
        ({"best_of": 3, "n": 4}, 400, "best_of"),  # best_of > n is honoured (not streamed) since issue 16
        ({"model": "other"}, 404, "other"),
        ({"response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
        ({"response_format": {"type": "json_object"}, "ebnf": 'root ::= "a"'}, 400, "one output constraint"),
    ],
)
def test_completion_invalid_requests(client, engine, patch, status, needle):
    for stream in (False, True):
        assert_error(client.post("/v1/completions", json={"prompt": "hi", "stream": stream, **patch}), status, needle)
    assert engine.requests == []


def test_completion_stream_echo_usage(client):
    full = client.post("/v1/completions", json={"prompt": "Q:", "max_tokens": 8, "echo": True}).json()
    r = client.post(
        "/v1/completions",
        json={"prompt": "Q:", "max_tokens": 8, "echo": True, "stream": True, "stream_options": {"include_usage": True}},
    )
    chunks = sse_payloads(r.text)
    assert chunks[0]["choices"][0]["text"] == "Q:"
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == full["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert all(c["object"] == "text_completion" for c in chunks)


def test_preferred_sampling_params_fill_only_unset_fields(tokenizer):
    # Regression: `radixserve up` answered OpenAI clients that send no temperature at 1.0, where the demo model rambles.
    engine = FakeEngine(tokenizer, preferred_sampling_params='{"temperature": 0.2, "top_p": 0.9}')
    client = TestClient(create_app(engine, manage_engine=False), raise_server_exceptions=False)
    assert (
        client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "max_tokens": 2}).status_code == 200
    )
    sp = engine.requests[-1].sampling_params
    assert (sp.temperature, sp.top_p) == (0.2, 0.9)
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 2, "temperature": 0.0, "top_p": 1.0}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    sp = engine.requests[-1].sampling_params
    assert (sp.temperature, sp.top_p) == (0.0, 1.0)
    r = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "top_p": 0.5}})
    assert r.status_code == 200
    sp = engine.requests[-1].sampling_params
    assert (sp.temperature, sp.top_p) == (0.2, 0.5)


@pytest.mark.parametrize("text", ['{"temperature": -1}', '{"seed": 3}', "[1]", "{bad"])
def test_preferred_sampling_params_rejects_bad_values(text):
    from radixserve.engine.engine import parse_sampling_defaults

    with pytest.raises(ValueError):
        parse_sampling_defaults(text)
