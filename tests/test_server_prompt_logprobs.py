"""Prompt-token logprobs through the HTTP layer over a fake engine (tests/fake_engine.py): native ``/generate``'s
``logprob_start_len`` → ``meta_info.input_token_logprobs`` / ``input_top_logprobs``, OpenAI completions' ``echo`` +
``logprobs``, and the 400s for bad values. The fake scores prompt position ``p`` as ``logprob_of(p, ...)``."""

import pytest

from radixserve.contracts import constants

from fake_engine import client, engine, sse_payloads, tokenizer  # noqa: F401 - shared pytest fixtures

FAKE_CONTEXT_LENGTH = 256
PROMPT = [11, 12, 13, 14, 15]


def gen(client, **body):
    body.setdefault("sampling_params", {"max_new_tokens": 2})
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def expected_entries(engine, ids, start, k, texts=None):
    """``(input_token_logprobs, input_top_logprobs)`` the fake's scores should give on the wire."""
    tokens, tops = [], []
    for p in range(start, len(ids)):
        text = texts(ids[p]) if texts else None
        if p == 0:
            tokens.append([None, ids[0], text])
            tops.append(None)
            continue
        lp = engine.logprob_of(p, ids[p], k)
        tokens.append([lp.logprob, ids[p], text])
        tops.append([[v, t, texts(t) if texts else None] for t, v in lp.top])
    return tokens, tops


# ------------------------------------------------------------------------------------------------------ native


@pytest.mark.parametrize("start", [0, 2, 4])
def test_native_input_logprobs_from_start(client, engine, start):
    m = gen(client, input_ids=PROMPT, return_logprob=True, logprob_start_len=start, top_logprobs_num=2)["meta_info"]
    tokens, tops = expected_entries(engine, PROMPT, start, 2)
    assert m["input_token_logprobs"] == tokens and m["input_top_logprobs"] == tops
    assert len(m["input_token_logprobs"]) == len(PROMPT) - start
    assert (m["input_token_logprobs"][0][0] is None) == (start == 0)  # only the first prompt token has none
    assert len(m["output_token_logprobs"]) == 2  # output logprobs as before
    assert engine.requests[0].logprob_start_len == start and engine.requests[0].top_logprobs_num == 2


def test_native_input_logprobs_with_text(client, engine, tokenizer):
    ids = tokenizer.encode("The capital of France")
    m = gen(
        client, text="The capital of France", return_logprob=True, logprob_start_len=0, return_text_in_logprobs=True
    )
    tokens, tops = expected_entries(engine, ids, 0, 0, lambda t: tokenizer.decode([t]))
    assert m["meta_info"]["input_token_logprobs"] == tokens
    assert m["meta_info"]["input_top_logprobs"] == [None] + [[] for _ in ids[1:]]
    assert "".join(e[2] for e in m["meta_info"]["input_token_logprobs"]) == "The capital of France"


def test_native_default_start_scores_no_prompt(client, engine):
    m = gen(client, input_ids=PROMPT, return_logprob=True)["meta_info"]
    assert m["input_token_logprobs"] == [] and m["input_top_logprobs"] == []
    assert engine.requests[0].logprob_start_len is None
    # Without return_logprob, logprob_start_len is ignored (as SGLang does): nothing scored, no logprob fields.
    m = gen(client, input_ids=PROMPT, logprob_start_len=1)["meta_info"]
    assert "input_token_logprobs" not in m and engine.requests[1].logprob_start_len is None


def test_native_batch_with_one_or_per_prompt_starts(client, engine):
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    for starts in (1, [1, 2]):
        engine.requests.clear()
        body = {"input_ids": prompts, "return_logprob": True, "logprob_start_len": starts}
        results = gen(client, sampling_params={"max_new_tokens": 1, "n": 2}, **body)
        each = starts if isinstance(starts, list) else [starts, starts]
        assert [g.logprob_start_len for g in engine.requests] == each
        assert len(results) == 4  # prompt-major, n samples each: every sample carries its prompt's logprobs
        for r, res in enumerate(results):
            ids, start = prompts[r // 2], each[r // 2]
            assert res["meta_info"]["input_token_logprobs"] == expected_entries(engine, ids, start, 0)[0]


def test_native_scoring_only_max_new_tokens_zero(client, engine):
    # lang's select: a batch of prompts scored, nothing generated, one engine prefill each.
    body = {"input_ids": [PROMPT, PROMPT[:3]], "return_logprob": True, "logprob_start_len": 1}
    results = gen(client, sampling_params={"max_new_tokens": 0}, **body)
    assert [r["output_ids"] for r in results] == [[], []]
    assert [len(r["meta_info"]["input_token_logprobs"]) for r in results] == [4, 2]
    assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in results)
    assert len(engine.requests) == 2


def test_native_stream_carries_input_logprobs_on_every_event(client, engine):
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0, "stream": True}
    events = sse_payloads(client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 3}}).text)
    tokens, _ = expected_entries(engine, PROMPT, 0, 0)
    assert len(events) == 3 and all(e["meta_info"]["input_token_logprobs"] == tokens for e in events)
    assert [len(e["meta_info"]["output_token_logprobs"]) for e in events] == [1, 1, 1]


def test_a_one_entry_list_for_one_prompt_is_its_value(client, engine):
    # Regression (new-user try): {"text": "a b", "logprob_start_len": [0]} was refused: "one entry per prompt".
    base = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 1}}
    plain = client.post("/generate", json={**base, "logprob_start_len": 1}).json()
    listed = client.post("/generate", json={**base, "logprob_start_len": [1]}).json()
    assert listed["meta_info"]["input_token_logprobs"] == plain["meta_info"]["input_token_logprobs"]
    assert len(plain["meta_info"]["input_token_logprobs"]) == len(PROMPT) - 1


@pytest.mark.parametrize(
    "patch, param, needle",
    [
        ({"logprob_start_len": 5}, "logprob_start_len", "the prompt has 5 tokens, got 5"),
        ({"logprob_start_len": 99}, "logprob_start_len", "[0, 5)"),
        ({"logprob_start_len": -2}, "logprob_start_len", "-1"),
        ({"logprob_start_len": True}, "logprob_start_len", "logprob_start_len"),
        ({"logprob_start_len": "1"}, "logprob_start_len", "logprob_start_len"),
        ({"logprob_start_len": [0, 1]}, "logprob_start_len", "one entry per prompt (1), got 2"),
        ({"input_ids": [PROMPT, [1]], "logprob_start_len": [0]}, "logprob_start_len", "one entry per prompt"),
        ({"input_ids": [PROMPT, [1]], "logprob_start_len": [0, 1]}, "logprob_start_len[1]", "[0, 1)"),
        ({"top_logprobs_num": -1}, "top_logprobs_num", "top_logprobs_num"),
        ({"top_logprobs_num": 21}, "top_logprobs_num", "[0, 20]"),
    ],
)
def test_native_bad_logprob_values_are_400(client, engine, patch, param, needle):
    for stream in (False, True):
        body = {"input_ids": PROMPT, "return_logprob": True, "stream": stream, **patch}
        r = client.post("/generate", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == 400 and err["type"] == constants.ERROR_TYPES[400]
        assert err["param"] == param and needle in err["message"], err
    assert engine.requests == []


# ------------------------------------------------------------------------------------------------- completions


def test_completions_echo_logprobs_score_every_prompt_token_but_the_first(client, engine, tokenizer):
    ids = tokenizer.encode("Paris is the capital")
    body = {"prompt": "Paris is the capital", "max_tokens": 2, "echo": True, "logprobs": 2}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp, n = choice["logprobs"], len(ids)
    assert engine.requests[0].logprob_start_len == 0 and engine.requests[0].top_logprobs_num == 2
    assert len(lp["tokens"]) == n + 2 and "".join(lp["tokens"][:n]) == "Paris is the capital"
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == [engine.logprob_of(p, ids[p], 2).logprob for p in range(1, n)]
    for p in range(1, n):
        top = lp["top_logprobs"][p]
        assert top[lp["tokens"][p]] == lp["token_logprobs"][p] and 1 <= len(top) <= 3
    assert all(v is not None for v in lp["token_logprobs"][n:])  # the generated tokens, as before
    assert lp["text_offset"][:n] == sorted(lp["text_offset"][:n]) and lp["text_offset"][n] == len(
        "Paris is the capital"
    )


def test_completions_prompt_logprobs_only_with_echo_and_logprobs(client, engine):
    for extra in ({"echo": True}, {"logprobs": 1}, {}):
        engine.requests.clear()
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **extra})
        assert engine.requests[0].logprob_start_len is None


def test_completions_echo_logprobs_batch_and_n(client, engine, tokenizer):
    prompts = ["one two three", "four five"]
    body = {"prompt": prompts, "max_tokens": 1, "n": 2, "echo": True, "logprobs": 0}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    assert len(choices) == 4
    for c in choices:
        ids = tokenizer.encode(prompts[c["index"] // 2])
        expected = [None] + [engine.logprob_of(p, ids[p], 0).logprob for p in range(1, len(ids))]
        assert c["logprobs"]["token_logprobs"][: len(ids)] == expected


def test_completions_stream_echo_chunk_carries_prompt_logprobs(client, engine):
    body = {"prompt": "Q: why", "max_tokens": 3, "echo": True, "logprobs": 1}
    full = client.post("/v1/completions", json=body).json()["choices"][0]
    chunks = sse_payloads(client.post("/v1/completions", json={**body, "stream": True}).text)
    assert chunks[0]["choices"][0]["text"] == "Q: why"
    merged = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in full["logprobs"]}
    assert merged == full["logprobs"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
