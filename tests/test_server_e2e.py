"""The whole engine server (real Engine, real model) through the official ``openai`` client: HTTP in, HTTP out.

One uvicorn server in a thread for the module (context length 2048). Greedy decoding keeps outputs comparable
between streamed and non-streamed requests.
"""

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from radixserve.engine.config import EngineArgs

from fake_engine import MODEL_DIR, ServerThread, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "smollm2-135m-instruct"
CONTEXT = 2048


@pytest.fixture(scope="module")
def server():
    import torch

    from radixserve.engine.engine import Engine
    from radixserve.engine.server.http import create_app

    torch.set_num_threads(2)
    engine = Engine(EngineArgs(model_path=MODEL_DIR, context_length=CONTEXT, num_threads=2, max_total_tokens=8192))
    with ServerThread(create_app(engine)) as url:
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 200, timeout_s=300)
        yield url, engine
    assert not engine.is_healthy()  # the lifespan shut it down


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", timeout=300, max_retries=0)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf"^radixserve_engine_{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_models_and_health(server, client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.model_extra["max_model_len"] == CONTEXT
    assert httpx.get(server[0] + "/health_generate", timeout=60).status_code == 200


def test_chat_sync_and_stream_agree(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**kwargs)
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("stop", "length")
    u = full.usage
    assert u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # The same prompt again hits the radix cache, reported as cached prompt tokens.
    again = client.chat.completions.create(**kwargs)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_stop_string_never_leaks(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Repeat exactly: alpha beta gamma delta"}],
        max_tokens=24,
        temperature=0,
        stop=["beta gamma"],
    )
    full = client.chat.completions.create(**kwargs).choices[0]
    assert "beta gamma" not in full.message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True))
    assert streamed == full.message.content


def test_chat_logprobs_shapes(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        # Greedy: the chosen token is the most likely one.
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4


def test_completion_legacy_logprobs_and_echo_zero(client):
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    r = client.completions.create(model=MODEL, prompt="Your answer: Yes", max_tokens=0, echo=True, logprobs=1)
    assert r.choices[0].text == "Your answer: Yes" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0


def test_completion_default_max_tokens(server):
    for body in ({"prompt": "Once upon a time"}, {"prompt": "Once upon a time", "max_tokens": None}):
        r = httpx.post(server[0] + "/v1/completions", json={**body, "temperature": 0}, timeout=300).json()
        assert 0 < r["usage"]["completion_tokens"] <= 16


def test_prompt_over_context_is_400(client):
    long = " ".join(["word"] * (CONTEXT + 100))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=long, max_tokens=16)
    assert str(CONTEXT) in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=CONTEXT)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_async_client_concurrent(server):
    async def go():
        aclient = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", timeout=300, max_retries=0)
        prompts = ["One", "Two", "Three"]
        rs = await asyncio.gather(
            *(aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts)
        )
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await aclient.close()
        return rs, parts

    rs, parts = asyncio.run(go())
    assert all(r.usage.completion_tokens > 0 for r in rs)
    assert "".join(parts)


def test_native_generate(server):
    url = server[0]
    greedy4 = {"max_new_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/generate", json={"text": ["1, 2, 3,", "a, b, c,"], "sampling_params": greedy4}, timeout=300)
    results = r.json()
    assert len(results) == 2 and all(x["meta_info"]["completion_tokens"] == 4 for x in results)
    assert results[0]["meta_info"]["finish_reason"] == {"type": "length", "matched": None}
    body = {"text": "1, 2, 3,", "sampling_params": greedy4, "stream": True}
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    streamed = "".join(json.loads(ln[6:])["text"] for ln in lines[:-1])
    assert streamed == results[0]["text"]
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 0}}
    zero = httpx.post(url + "/generate", json=body, timeout=60).json()
    assert zero["text"] == "" and zero["meta_info"]["finish_reason"]["type"] == "length"


def test_disconnects_free_everything(server, client):
    url, engine = server
    aborted_before = metric(url, "num_aborted_requests_total")
    for i in range(4):
        body = {"prompt": f"Count: {i}", "max_tokens": 1000, "stream": True, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as s:
            next(s.iter_lines())
    with pytest.raises(httpx.ReadTimeout):
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
        httpx.post(url + "/v1/completions", json=body, timeout=2)
    assert wait_until(lambda: metric(url, "num_running_reqs") == 0 and metric(url, "num_queue_reqs") == 0, 120)
    assert wait_until(lambda: metric(url, "num_aborted_requests_total") >= aborted_before + 5, 60)
    time.sleep(0.5)
    assert httpx.get(url + "/health").status_code == 200
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4 or r.choices[0].finish_reason == "stop"


# ---- regressions from a new user's break-it session (each input once crashed or hung the engine, or gave a 500)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_out_of_range_seed_is_400_and_engine_survives(server, seed):
    url, engine = server
    r = httpx.post(url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2, "seed": seed}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    r = httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": seed},
    )
    assert r.status_code == 400, r.text
    assert engine.is_healthy()


def test_largest_seed_with_n_samples_is_served(server):
    url, engine = server
    body = {"text": "a", "sampling_params": {"max_new_tokens": 2, "seed": 2**64 - 1, "n": 2}}
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()) == 2
    assert engine.is_healthy()


@pytest.mark.parametrize(
    "field,value",
    [
        ("skip_special_tokens", None),
        ("skip_special_tokens", "yes"),
        ("ignore_eos", "no"),
        ("no_stop_trim", None),
        ("regex", 5),
    ],
)
def test_non_boolean_flags_are_400(server, field, value):
    url, engine = server
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 3, field: value}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert engine.is_healthy()


def test_lone_surrogate_is_400_everywhere(server):
    url, engine = server
    bad = "\ud800"
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": bad, "max_tokens": 3}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["ok", bad], "max_tokens": 3}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": bad}]}, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": bad}]}]},
            "messages",
        ),
        ("/generate", {"text": bad, "sampling_params": {"max_new_tokens": 2}}, "text"),
    ]
    for path, body, param in cases:
        # json.dumps escapes the surrogate as \ud800, exactly what a client sends
        r = httpx.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    assert engine.is_healthy()


def test_request_the_scheduler_cannot_take_fails_alone(server):
    """Defence in depth: a request that slipped past validation is answered with an error; the loop survives."""
    from radixserve.engine.io_struct import GenerateRequest, SamplingParams

    url, engine = server

    async def go():
        req = GenerateRequest("bypass-validation", [1, 2, 3], SamplingParams(max_new_tokens=2, seed="x"))  # type: ignore
        return [out async for out in engine.generate(req)]

    outs = asyncio.run(go())
    assert outs[-1].finish_reason["type"] == "abort" and outs[-1].finish_reason["status_code"] == 400
    assert engine.is_healthy()
    r = httpx.post(url + "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200


def test_prompt_logprobs_match_output_logprobs(server, client):
    # A greedy token's output logprob and its logprob as a prompt token (the prompt + that token, scored) are the
    # same quantity, from two prefills; completions' echo + logprobs report the same prompt logprobs.
    url, engine = server
    ids = engine.tokenizer.encode("The capital of France is")
    greedy = {"max_new_tokens": 1, "temperature": 0}
    body = {"input_ids": ids, "sampling_params": greedy, "return_logprob": True, "top_logprobs_num": 3}
    out = httpx.post(url + "/generate", json=body, timeout=300).json()["meta_info"]
    ((lp, tok, _),) = out["output_token_logprobs"]
    body = {
        "input_ids": ids + [tok],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
    }
    scored = httpx.post(url + "/generate", json=body, timeout=300).json()["meta_info"]
    entries, tops = scored["input_token_logprobs"], scored["input_top_logprobs"]
    assert [e[1] for e in entries] == ids + [tok] and entries[0][0] is None and tops[0] is None
    assert all(e[0] <= 0 for e in entries[1:]) and all(len(t) == 3 for t in tops[1:])
    assert entries[-1][0] == pytest.approx(lp, abs=0.05)
    assert tops[-1][0][1] == tok  # greedy: the token was the most likely one there too
    r = client.completions.create(model=MODEL, prompt=ids + [tok], max_tokens=0, echo=True, logprobs=2)
    legacy = r.choices[0].logprobs
    assert legacy.token_logprobs[0] is None and legacy.top_logprobs[0] is None
    assert legacy.token_logprobs[1:] == pytest.approx([e[0] for e in entries[1:]], abs=1e-3)
    assert all(len(t) <= 3 for t in legacy.top_logprobs[1:])
