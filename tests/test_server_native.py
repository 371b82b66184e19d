"""Native POST /generate over a fake engine (tests/fake_engine.py)."""

import pytest

from fake_engine import client, engine, sse_payloads, tokenizer  # noqa: F401 - shared pytest fixtures

FAKE_CONTEXT_LENGTH = 256


def test_single_text(client, engine, tokenizer):
    engine.cached_tokens = 1
    r = client.post("/generate", json={"text": "The sky is", "sampling_params": {"max_new_tokens": 3}, "rid": "g1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_ids"] == engine.script_ids[:3]
    assert body["text"] == tokenizer.decode(engine.script_ids[:3])
    assert body["meta_info"] == {
        "id": "g1",
        "prompt_tokens": len(tokenizer.encode("The sky is")),
        "completion_tokens": 3,
        "cached_tokens": 1,
        "finish_reason": {"type": "length", "matched": None},
    }
    assert engine.requests[0].rid == "g1"


def test_default_max_new_tokens_128_and_stop_matched(client, engine):
    body = client.post("/generate", json={"input_ids": [5, 6, 7]}).json()
    assert engine.requests[0].sampling_params.max_new_tokens == 128
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": engine.eos_id}


def test_batch_and_n(client, engine):
    r = client.post("/generate", json={"text": ["a", "b c"], "sampling_params": {"max_new_tokens": 2, "n": 2}})
    results = r.json()
    assert isinstance(results, list) and len(results) == 4
    assert [x["output_ids"] for x in results] == [engine.sample_ids(i % 2)[:2] for i in range(4)]
    assert [x["meta_info"]["prompt_tokens"] for x in results] == [1, 1, 2, 2]
    assert len({x["meta_info"]["id"] for x in results}) == 4
    single_n = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"n": 2, "max_new_tokens": 1}})
    assert isinstance(single_n.json(), list) and len(single_n.json()) == 2
    batch_one = client.post("/generate", json={"input_ids": [[1, 2]], "sampling_params": {"max_new_tokens": 1}})
    assert isinstance(batch_one.json(), list) and len(batch_one.json()) == 1


def test_per_prompt_sampling_params(client, engine):
    sps = [{"max_new_tokens": 1}, {"max_new_tokens": 3}]
    r = client.post("/generate", json={"input_ids": [[1], [2]], "sampling_params": sps})
    assert [x["meta_info"]["completion_tokens"] for x in r.json()] == [1, 3]


def test_max_new_tokens_zero(client, engine):
    body = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 0}}).json()
    assert body["text"] == "" and body["output_ids"] == []
    assert body["meta_info"]["finish_reason"]["type"] == "length" and body["meta_info"]["completion_tokens"] == 0


def test_logprobs(client, engine):
    body = client.post(
        "/generate",
        json={
            "input_ids": [3, 4],
            "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    ).json()
    m = body["meta_info"]
    assert [e[1] for e in m["output_token_logprobs"]] == body["output_ids"]
    assert all(e[0] <= 0 and isinstance(e[2], str) for e in m["output_token_logprobs"])
    assert all(len(top) == 2 and top[0][0] >= top[1][0] for top in m["output_top_logprobs"])


def test_stream(client, engine):
    full = client.post("/generate", json={"text": ["x", "y"], "sampling_params": {"max_new_tokens": 10}}).json()
    r = client.post("/generate", json={"text": ["x", "y"], "sampling_params": {"max_new_tokens": 10}, "stream": True})
    chunks = sse_payloads(r.text)
    for i in range(2):
        mine = [c for c in chunks if c["index"] == i]
        assert "".join(c["text"] for c in mine) == full[i]["text"]
        assert [t for c in mine for t in c["output_ids"]] == full[i]["output_ids"]
        assert mine[-1]["meta_info"]["finish_reason"] == {"type": "length", "matched": None}
        assert all(c["meta_info"]["finish_reason"] is None for c in mine[:-1])


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"text": "a", "input_ids": [1]}, "exactly one"),
        ({}, "exactly one"),
        ({"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 256}}, "256"),
        ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "a", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "at most one"),
        ({"text": "a", "sampling_params": {"regex": 5}}, "regex"),
        ({"input_ids": [1, 50000]}, "token ids"),
        ({"input_ids": list(range(300))}, "256"),
        ({"text": "a", "top_logprobs_num": 30}, "top_logprobs_num"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": "a", "rid": ["x", "y"]}, "rid"),
    ],
)
def test_invalid(client, engine, body, needle):
    for stream in (False, True):
        r = client.post("/generate", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"] and r.json()["error"]["code"] == 400
    assert engine.requests == []
