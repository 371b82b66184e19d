"""Black-box cases from real users' reports, against the whole server and the real model.

Each case is a failure that public LLM servers (SGLang, vLLM, llama.cpp, TGI) shipped and users reported; the expected
behaviour is what a careful user of the OpenAI API would expect, and a plain request must still be served after each:

1. Streaming never splits a multi-byte character: every SSE line is valid JSON, no delta holds U+FFFD the
   non-streamed text lacks there, and the deltas concatenate to the non-streamed text.
2. Stop strings never leak, even split across tokens: no chunk holds the stop string or a prefix of it that later
   completes; streamed == non-streamed == text before the stop; held-back text is flushed on another finish.
3. logprobs in the OpenAI shapes: chat ``logprobs.content`` (with sorted ``top_logprobs``), legacy completions
   (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``); ``top_logprobs`` without ``logprobs`` or
   over 20 is a 400.
4. ``max_tokens`` 0 (with ``echo``, and native ``max_new_tokens`` 0): never a 5xx or a dead engine.
5. ``max_tokens`` null or missing: 200 with the documented default, never past the context length.
6. Prompts at or over the context length: 400 naming both numbers; other requests unaffected.
7. Invalid JSON schemas (sent twice, the second hitting the grammar cache): 400 both times, never unconstrained.
8. Constrained JSON terminates: 20 varied greedy prompts all parse and validate, finish_reason "stop".
9. Regex edge cases answer in bounded time: empty -> 400 or an empty completion; IPv4 -> a full match; a
   backreference the grammar engine cannot express -> 400.
10. Disconnects free everything: after streams and requests closed early and aborts, running and queued counts and
    used KV tokens return to idle, the abort counter rises, nothing grows across cycles, health stays 200.

One real ``Engine`` (fp32, so greedy decoding is deterministic across batch shapes) behind uvicorn on a free port for
the module; every test talks HTTP only (httpx for raw SSE lines, the official ``openai`` client elsewhere). After
every test an autouse fixture waits for the engine to drain and checks that a plain greedy request is still served
exactly as at the start. Cases 7-9 exercise constrained decoding (xgrammar): invalid grammars are HTTP 400s (also for
streams), valid ones always parse / fully match.

The engine runs at most 8 requests at once so case 10 can build a real queue with a handful of requests.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import openai
import pytest

from radixserve.engine.config import EngineArgs

from fake_engine import MODEL_DIR, ServerThread, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MODEL = "smollm2-135m-instruct"
C = 2048  # the engine's context length
MAX_RUNNING = 8
REPLACEMENT = "\ufffd"
PLAIN = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


# ---------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server():
    """``(base_url, tokenizer, plain_reference_text)`` of one real engine served by uvicorn."""
    import torch

    from radixserve.engine.engine import Engine
    from radixserve.engine.server.http import create_app

    torch.set_num_threads(2)
    engine = Engine(
        EngineArgs(
            model_path=MODEL_DIR,
            context_length=C,
            num_threads=2,
            dtype="float32",
            max_total_tokens=16384,
            max_running_requests=MAX_RUNNING,
        )
    )
    with ServerThread(create_app(engine)) as url:
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 200, timeout_s=300)
        r = httpx.post(url + "/v1/completions", json=PLAIN, timeout=300)
        assert r.status_code == 200, r.text
        yield url, engine.tokenizer, r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def tok(server) -> Any:
    return server[1]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=300, max_retries=0)


@pytest.fixture(autouse=True)
def still_serves(server):
    """After every case: nothing left running or queued, and a plain greedy request is served as at the start."""
    yield
    url, _, reference = server
    assert wait_until(lambda: metric(url, "num_running_reqs") == 0 and metric(url, "num_queue_reqs") == 0, 120), (
        "requests left running or queued after the case"
    )
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    r = httpx.post(url + "/v1/completions", json=PLAIN, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == reference and choice["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------------------------- helpers


def metric(url: str, name: str) -> float:
    """One ``radixserve_engine_<name>`` sample from ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(rf"^radixserve_engine_{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def sse_events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST a streaming request; every ``data:`` line must be valid JSON and the stream must end with ``[DONE]``."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    events = []
    for ln in lines[:-1]:
        assert ln.startswith("data: "), ln
        events.append(json.loads(ln[len("data: ") :]))  # raises on invalid JSON (e.g. a cut character)
    assert all("error" not in e for e in events), events
    return events


def post(url: str, path: str, body: dict[str, Any], timeout: float = 300) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


def assert_error(r: httpx.Response, status: int, *needles: str) -> str:
    """``r`` is an OpenAI error body with ``status`` whose message contains every needle; returns the message."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()["error"]
    assert set(r.json()) == {"error"} and body["code"] == status
    for n in needles:
        assert n in body["message"], (n, body["message"])
    return body["message"]


def chat_body(content: str, **kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **kw}


# ---------------------------------------------------------------------------------------------------------- case 1

COPY_PROMPT = "Copy this line exactly:\nCafé 日本語 🙂 naïve — ok 🎉 中文 señor\nCopy:\n"


def _wide(text: str) -> set[int]:
    """UTF-8 lengths (2, 3, 4) of the non-ASCII characters in ``text``."""
    return {len(c.encode()) for c in text if ord(c) > 127}


def test_case1_completion_stream_never_splits_a_character(url, tok):
    body = {"prompt": COPY_PROMPT, "max_tokens": 40, "temperature": 0}
    full = post(url, "/v1/completions", body).json()["choices"][0]["text"]
    # The model copies the line: 2-, 3- and 4-byte characters, some split over several byte-level tokens.
    assert _wide(full) >= {2, 3, 4}, full
    assert REPLACEMENT not in full
    events = sse_events(url, "/v1/completions", body)
    deltas = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert all(REPLACEMENT not in d for d in deltas), deltas
    assert "".join(deltas) == full
    # Independent reference: the tokenizer's decode of the generated ids (native endpoint, same greedy run).
    native = post(url, "/generate", {"text": COPY_PROMPT, "sampling_params": {"max_new_tokens": 40, "temperature": 0}})
    ids = native.json()["output_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == full == native.json()["text"]


def test_case1_chat_and_native_streams_never_split_a_character(url):
    body = chat_body("Copy this line exactly: Café 日本語 🙂 naïve — ok", max_tokens=30)
    full = post(url, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert _wide(full) >= {2, 3, 4}, full
    events = sse_events(url, "/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
    assert all(REPLACEMENT not in d for d in deltas) and "".join(deltas) == full

    native = {"text": COPY_PROMPT, "sampling_params": {"max_new_tokens": 40, "temperature": 0}}
    full = post(url, "/generate", native).json()["text"]
    parts = [e["text"] for e in sse_events(url, "/generate", native)]
    assert all(REPLACEMENT not in p for p in parts) and "".join(parts) == full


def test_case1_cut_inside_a_character_matches_non_streamed(url, tok):
    """max_tokens ending inside a multi-byte character: the replacement character appears once, at the end, in the
    streamed and the non-streamed text alike (it is what the tokenizer decodes), never earlier in a delta."""
    native = post(url, "/generate", {"text": COPY_PROMPT, "sampling_params": {"max_new_tokens": 40, "temperature": 0}})
    ids = native.json()["output_ids"]
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(REPLACEMENT)]
    assert cuts, "the copied line has no character split over tokens"
    k = cuts[0]
    body = {"prompt": COPY_PROMPT, "max_tokens": k, "temperature": 0}
    choice = post(url, "/v1/completions", body).json()["choices"][0]
    assert choice["text"] == tok.decode(ids[:k]) and choice["finish_reason"] == "length"
    deltas = [e["choices"][0]["text"] for e in sse_events(url, "/v1/completions", body) if e["choices"]]
    assert "".join(deltas) == choice["text"]
    assert all(REPLACEMENT not in d for d in deltas[:-1])


# ---------------------------------------------------------------------------------------------------------- case 2


def _stream_chat_text(client, **kwargs: Any) -> tuple[list[str], str | None]:
    parts, finish = [], None
    for c in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        if c.choices:
            parts.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
    return parts, finish


@pytest.mark.parametrize(
    "prompt,stop,max_tokens",
    [
        # "Observations" is several tokens ("Obs" "erv" ...) well inside the answer.
        ("Explain what an Observation is in a scientific experiment.", "Observation", 80),
        # The stop string is the very first thing the model says.
        ("Say the word Observation three times.", "Observation", 12),
        # A multi-token stop string (" beta" " gamma").
        ("Repeat exactly: alpha beta gamma delta", "beta gamma", 24),
    ],
)
def test_case2_stop_string_never_leaks(client, prompt, stop, max_tokens):
    messages = [{"role": "user", "content": prompt}]
    base = dict(messages=messages, max_tokens=max_tokens, temperature=0)
    unstopped = client.chat.completions.create(model=MODEL, **base).choices[0].message.content
    assert stop in unstopped, unstopped  # the prompt really makes the model say it
    expected = unstopped[: unstopped.index(stop)]

    full = client.chat.completions.create(model=MODEL, stop=[stop], **base).choices[0]
    assert full.message.content == expected and full.finish_reason == "stop"
    parts, finish = _stream_chat_text(client, stop=[stop], **base)
    assert "".join(parts) == expected and finish == "stop"
    assert not any(stop in p for p in parts)


def test_case2_held_back_text_is_flushed_at_length_and_eos(client, url):
    """A possible stop-string prefix held back is released when generation ends for another reason."""
    prompt = "Repeat exactly: alpha beta gamma delta"
    unstopped = post(url, "/v1/chat/completions", chat_body(prompt, max_tokens=24, logprobs=True)).json()
    tokens = [e["bytes"] for e in unstopped["choices"][0]["logprobs"]["content"]]
    prefixes = [bytes(b for t in tokens[:k] for b in t).decode("utf-8", "replace") for k in range(len(tokens) + 1)]
    # Length: stop just after " beta" (a proper prefix of "beta gamma", so held back until the end).
    k = next(i for i, p in enumerate(prefixes) if p.endswith(" beta") and "beta gamma" not in p)
    base = dict(messages=[{"role": "user", "content": prompt}], max_tokens=k, temperature=0, stop=["beta gamma"])
    full = client.chat.completions.create(model=MODEL, **base).choices[0]
    assert full.message.content == prefixes[k] and full.finish_reason == "length"
    parts, finish = _stream_chat_text(client, **base)
    assert "".join(parts) == prefixes[k] and finish == "length"

    # EOS: the answer ends with "4." and EOS; "4. Indeed" is never completed, so "4." is held then flushed.
    messages = [{"role": "user", "content": "What is 2+2?"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0).choices[0]
    assert plain.finish_reason == "stop" and plain.message.content.endswith("4."), plain.message.content
    stop = ["4. Indeed"]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=stop)
    assert full.choices[0].message.content == plain.message.content and full.choices[0].finish_reason == "stop"
    parts, finish = _stream_chat_text(client, messages=messages, max_tokens=40, temperature=0, stop=stop)
    assert "".join(parts) == plain.message.content and finish == "stop"


# ---------------------------------------------------------------------------------------------------------- case 3


def test_case3_chat_logprobs_without_top_logprobs(url):
    body = chat_body("Copy this line exactly: Café 日本語 🙂", max_tokens=12, logprobs=True)
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 12
    for e in content:
        assert set(e) >= {"token", "logprob", "bytes", "top_logprobs"}
        assert e["logprob"] <= 0 and e["top_logprobs"] == []
        assert e["bytes"] and all(0 <= b < 256 for b in e["bytes"])
    # Token bytes concatenate to the UTF-8 of the answer, even where a token holds part of a character (an EOS
    # that ended the answer is a counted token with its own entry, but not part of the text).
    text_entries = content[:-1] if choice["finish_reason"] == "stop" else content
    assert _wide(choice["message"]["content"]) >= {2, 3, 4}
    assert bytes(b for e in text_entries for b in e["bytes"]).decode("utf-8") == choice["message"]["content"]


def test_case3_chat_top_logprobs_sorted_streamed_and_not(client):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token  # greedy picks the most likely token
    streamed = [
        e
        for c in client.chat.completions.create(**kwargs, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_case3_completion_legacy_logprobs(url):
    r = post(
        url, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    )
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(6)]
    for tok_text, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert v <= 0 and 1 <= len(top) <= 3 and tok_text in top
        assert abs(max(top.values()) - v) < 1e-4  # greedy: the sampled token is the most likely one


def _check_offsets(text: str, lp: dict[str, Any]) -> None:
    """``text_offset`` indexes into ``text``: each whole-character token is found where its offset says."""
    offs = lp["text_offset"]
    assert offs == sorted(offs) and all(0 <= o <= len(text) for o in offs)
    for token, off in zip(lp["tokens"], offs):
        assert token.startswith("bytes:") or text[off:].startswith(token), (token, off, text)


def test_case3_legacy_offsets_with_characters_split_over_tokens(url):
    """Regression: offsets advanced by the length of each token's text, and a partial character counted as one
    U+FFFD per token, so offsets ran past the text; partial tokens all showed as U+FFFD and collided as keys of
    ``top_logprobs``. Now partial tokens are ``bytes:\\xNN`` (OpenAI's convention) and offsets index the text."""
    body = {"prompt": COPY_PROMPT, "max_tokens": 14, "temperature": 0, "logprobs": 2}
    choice = post(url, "/v1/completions", body).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert _wide(text) >= {3, 4} and any(t.startswith("bytes:") for t in lp["tokens"])
    _check_offsets(text, lp)
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert token in top and len(top) >= 2  # two distinct alternatives, even when they are partial characters
    # Streamed: the same tokens and offsets, carried across chunks.
    events = [e for e in sse_events(url, "/v1/completions", body) if e["choices"]]
    streamed = {
        k: [x for e in events if e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"][k]]
        for k in ("tokens", "text_offset")
    }
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    # Echo: the prompt's tokens come first, and the completion's offsets continue after the prompt's text.
    echoed = post(url, "/v1/completions", {**body, "echo": True}).json()
    choice = echoed["choices"][0]
    assert choice["text"] == COPY_PROMPT + text
    _check_offsets(choice["text"], choice["logprobs"])
    n_prompt = echoed["usage"]["prompt_tokens"]
    assert choice["logprobs"]["text_offset"][n_prompt] == len(COPY_PROMPT)
    # The prompt is scored too: a logprob for every prompt token but the first, which has nothing before it.
    scores = choice["logprobs"]["token_logprobs"]
    assert scores[0] is None and all(isinstance(v, float) and v <= 0 for v in scores[1:])


def test_case3_invalid_logprob_requests_are_400(url):
    r = post(url, "/v1/chat/completions", chat_body("Hi", max_tokens=2, top_logprobs=2))
    assert_error(r, 400, "logprobs")
    r = post(url, "/v1/chat/completions", chat_body("Hi", max_tokens=2, logprobs=True, top_logprobs=21))
    assert_error(r, 400, "20")
    r = post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logprobs": 21})
    assert_error(r, 400, "20")


# ---------------------------------------------------------------------------------------------------------- case 4


def test_case4_max_tokens_zero_with_echo(url, tok):
    body = {"prompt": "Your answer: Yes", "max_tokens": 0, "echo": True, "logprobs": 1}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["text"] == "Your answer: Yes" and choice["finish_reason"] == "length"
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(tok.encode("Your answer: Yes"))
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == "Your answer: Yes" and len(lp["token_logprobs"]) == usage["prompt_tokens"]
    # Streamed: the echo, then a final chunk with finish_reason "length", then [DONE].
    events = sse_events(url, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events) == "Your answer: Yes"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # Chat and native with zero new tokens.
    r = post(url, "/v1/chat/completions", chat_body("Hi", max_tokens=0))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ""
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0
    r = post(url, "/generate", {"text": "Your answer: Yes", "sampling_params": {"max_new_tokens": 0}})
    meta = r.json()["meta_info"]
    assert r.json()["text"] == "" and meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 0
    parts = sse_events(url, "/generate", {"text": "Your answer: Yes", "sampling_params": {"max_new_tokens": 0}})
    assert parts[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_case4_echo_offsets_cover_prompt_and_completion(url):
    body = {"prompt": "Your answer: Yes", "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    choice = post(url, "/v1/completions", body).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith("Your answer: Yes") and "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert lp["token_logprobs"][-3:] == [v for v in lp["token_logprobs"][-3:] if v is not None and v <= 0]


# ---------------------------------------------------------------------------------------------------------- case 5


def _chat_prompt_len(tok: Any, content: str) -> int:
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("explicit_null", [False, True])
def test_case5_max_tokens_default(url, tok, explicit_null):
    extra = {"max_tokens": None} if explicit_null else {}
    # Completions: OpenAI's 16.
    r = post(url, "/v1/completions", {"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"
    # Chat: the room left in the context; a short question ends by itself (EOS).
    r = post(url, "/v1/chat/completions", chat_body("What is 2+2?", **extra))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop" and 0 < r.json()["usage"]["completion_tokens"] < C
    # Near the context length the default is clamped to the room left, never more.
    ids = (tok.encode(" one two three four five six seven eight nine ten") * 300)[: C - 5]
    r = post(url, "/v1/completions", {"prompt": ids, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"
    unit = "one two three four five six seven eight nine ten "
    per_unit = _chat_prompt_len(tok, unit * 2) - _chat_prompt_len(tok, unit)
    filler = unit * ((C - 8 - _chat_prompt_len(tok, "")) // per_unit)
    body = chat_body(filler, ignore_eos=True, **extra)
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert C - 20 < usage["prompt_tokens"] < C and usage["prompt_tokens"] + usage["completion_tokens"] == C
    assert r.json()["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------------------------- case 6


def _ids(tok: Any, n: int) -> list[int]:
    base = tok.encode("The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. ")
    return (base * (n // len(base) + 1))[:n]


def test_case6_prompt_at_or_over_context_length(url, tok):
    async def go() -> tuple[list[httpx.Response], list[str], str]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            # A request in flight the whole time: its output must be what it is alone.
            story = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
            alone = (await c.post("/v1/completions", json=story)).json()["choices"][0]["text"]
            inflight = asyncio.ensure_future(c.post("/v1/completions", json={**story, "stream": True}))
            bodies = [
                {"prompt": _ids(tok, C + 100), "max_tokens": 16},
                {"prompt": _ids(tok, C), "max_tokens": 16},
                {"prompt": _ids(tok, C - 1), "max_tokens": 16},
                {"prompt": _ids(tok, C // 2), "max_tokens": C},
            ]
            rs = [await c.post("/v1/completions", json=b) for b in bodies]
            rs.append(await c.post("/generate", json={"input_ids": _ids(tok, C), "sampling_params": {}}))
            rs.append(await c.post("/v1/chat/completions", json=chat_body("word " * (C + 10), max_tokens=16)))
            streamed = await inflight
            parts = [
                json.loads(ln[6:])["choices"][0]["text"]
                for ln in streamed.text.splitlines()
                if ln.startswith("data: {")
            ]
            return rs, parts, alone

    rs, parts, alone = asyncio.run(go())
    assert_error(rs[0], 400, str(C), str(C + 100))
    assert_error(rs[1], 400, str(C), f"{C} tokens")
    assert_error(rs[2], 400, str(C), str(C - 1), "16")
    assert_error(rs[3], 400, str(C), str(C // 2), str(C // 2 + C))
    assert_error(rs[4], 400, str(C))
    assert_error(rs[5], 400, str(C))
    assert "".join(parts) == alone


def test_case6_boundary_prompts_are_served(url, tok):
    # C - 1 prompt tokens leave room for exactly one token, explicit or by the default's clamp.
    for extra in ({"max_tokens": 1}, {}):
        r = post(url, "/v1/completions", {"prompt": _ids(tok, C - 1), "temperature": 0, "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {**r.json()["usage"], "prompt_tokens": C - 1, "completion_tokens": 1}
        assert r.json()["choices"][0]["finish_reason"] == "length"
    # C/2 prompt with all the room left.
    r = post(url, "/v1/completions", {"prompt": _ids(tok, C // 2), "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == C // 2


# ---------------------------------------------------------------------------------------------------------- cases 7-9


BAD_SCHEMAS = [
    ({"type": "object", "properties": {"foo": "bar"}}, "bar"),
    ({"type": "array", "items": 5}, "items"),
    ({"$ref": "#/definitions/missing"}, "definitions"),
]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _person_format(schema: dict[str, Any] = PERSON) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


@pytest.mark.parametrize("schema, needle", BAD_SCHEMAS)
def test_case7_invalid_json_schema_is_400_twice(url, schema, needle):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    hits = metric(url, "grammar_cache_hits_total")
    for _ in range(2):  # the second one hits the grammar cache (failures are cached too)
        r = post(url, "/v1/chat/completions", chat_body("Give me JSON.", max_tokens=8, response_format=fmt))
        assert_error(r, 400, "invalid json_schema", needle)
        r = post(url, "/v1/completions", {"prompt": "JSON:", "max_tokens": 8, "response_format": fmt})
        assert_error(r, 400, "invalid json_schema", needle)
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            timeout=60,
            json=chat_body("Give me JSON.", max_tokens=8, response_format=fmt, stream=True),
        ) as s:
            assert s.status_code == 400  # an HTTP error, not an SSE error event after a 200
    assert metric(url, "grammar_cache_hits_total") >= hits + 5
    # A valid schema right after is served, constrained.
    r = post(
        url, "/v1/chat/completions", chat_body("Describe a person.", max_tokens=64, response_format=_person_format())
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    import jsonschema

    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


CASE8_PROMPTS = [
    "Describe a person.",
    "Invent a character for a novel.",
    "Who is the main character of your favourite book?",
    "Make a table of three people with their names and ages.",
    "请用中文介绍一个人。",
    "Describe your grandmother.",
    "Tell me about a famous scientist.",
    "Create a profile for a new employee.",
    "Describe a marathon winner.",
    "Describe a teacher you remember.",
    "Invent a superhero.",
    "Describe a baby born today.",
    "Give me a random user for a test database.",
    "Who is the oldest person you know of?",
    "Describe a chef in Paris.",
    "Write about a pilot.",
    "Describe a child at school.",
    "Tell me about an astronaut.",
    "Describe a retired footballer.",
    "Who is your neighbour?",
]


def test_case8_constrained_json_terminates_and_validates(url):
    import jsonschema

    async def one(client: httpx.AsyncClient, prompt: str) -> dict[str, Any]:
        r = await client.post(
            url + "/v1/chat/completions", json=chat_body(prompt, max_tokens=256, response_format=_person_format())
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(*[one(client, p) for p in CASE8_PROMPTS])

    before = metric(url, "num_constrained_requests_total")
    bad = []
    for prompt, choice in zip(CASE8_PROMPTS, asyncio.run(go())):
        text = choice["message"]["content"]
        if choice["finish_reason"] != "stop":
            bad.append((prompt, choice["finish_reason"], text))
            continue
        jsonschema.validate(json.loads(text), PERSON)
        assert not re.search(r"\s{2,}", text) and text == text.strip(), (prompt, text)  # no runaway whitespace
    assert not bad, bad
    assert metric(url, "num_constrained_requests_total") >= before + len(CASE8_PROMPTS)
    # json_object and the native json_schema parse too.
    r = post(
        url,
        "/v1/chat/completions",
        chat_body("Describe a car as JSON.", max_tokens=128, response_format={"type": "json_object"}),
    )
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    r = post(
        url,
        "/generate",
        {
            "text": "Person:",
            "sampling_params": {"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 128},
        },
    )
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["text"]), PERSON)


IPV4 = r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"


def test_case9_regex_edge_cases(url):
    t0 = time.monotonic()
    # Empty regex: only the empty string matches, so only eos is allowed: an empty completion, finish "stop".
    r = post(
        url,
        "/generate",
        {"text": "IP address:", "sampling_params": {"regex": "", "temperature": 0, "max_new_tokens": 16}},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "" and r.json()["meta_info"]["finish_reason"]["type"] == "stop"
    r = post(url, "/v1/completions", {"prompt": "IP address:", "max_tokens": 16, "regex": ""}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "" and r.json()["choices"][0]["finish_reason"] == "stop"
    # IPv4, greedy: the whole output matches.
    r = post(
        url,
        "/generate",
        {
            "text": "The IP address of the local host is ",
            "sampling_params": {"regex": IPV4, "temperature": 0, "max_new_tokens": 24},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert re.fullmatch(IPV4, r.json()["text"]), r.json()["text"]
    assert r.json()["meta_info"]["finish_reason"]["type"] == "stop"
    r = post(
        url, "/v1/completions", {"prompt": "IP address:", "max_tokens": 24, "regex": IPV4, "temperature": 0}, timeout=60
    )
    assert r.status_code == 200 and re.fullmatch(IPV4, r.json()["choices"][0]["text"]), r.text
    # A backreference xgrammar cannot express: 400 naming it, twice (cached), streaming too.
    for stream in (False, True, False):
        r = post(url, "/generate", {"text": "x", "stream": stream, "sampling_params": {"regex": r"(a+)\1"}}, timeout=60)
        assert_error(r, 400, "Backreference")
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 8, "regex": r"(a+)\1"}, timeout=60)
    assert_error(r, 400, "Backreference")
    # EBNF works.
    r = post(
        url,
        "/generate",
        {"text": "Grammar:", "sampling_params": {"ebnf": 'root ::= "a" | "b"', "temperature": 0}},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["text"] in ("a", "b"), r.text
    assert time.monotonic() - t0 < 120


# ---------------------------------------------------------------------------------------------------------- case 10

CYCLES = 3
PER_KIND = 8
GIVE_UP = 4


async def _poll(c: httpx.AsyncClient, cond: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        text = (await c.get("/metrics")).text
        values = {
            m.group(1): float(m.group(2)) for m in re.finditer(r"^radixserve_engine_(\w+)\{[^}]*\} (\S+)$", text, re.M)
        }
        if cond(values):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)


async def _disconnect_cycle(url: str, cycle: int) -> int:
    """One cycle of case 10; returns the number of requests the engine had to abort."""
    long = {"max_tokens": C - 200, "ignore_eos": True, "temperature": 0}
    native_long = {"max_new_tokens": C - 200, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=64)) as c:
        # 1. Non-streaming requests (OpenAI and native) fill every running slot.
        nonstream = [
            asyncio.ensure_future(
                c.post("/v1/completions", json={"prompt": f"Cycle {cycle}, story {j}:", **long})
                if j % 2
                else c.post("/generate", json={"text": f"Cycle {cycle}, story {j}:", "sampling_params": native_long})
            )
            for j in range(PER_KIND)
        ]
        assert await _poll(c, lambda v: v["num_running_reqs"] == MAX_RUNNING, 120)

        # 2. Streaming requests (completions and chat) queue behind them; each client closes after the first chunk.
        async def first_chunk_then_close(j: int) -> str:
            if j % 2:
                path, body = "/v1/completions", {"prompt": f"Cycle {cycle}, stream {j}:", "stream": True, **long}
            else:
                path, body = "/v1/chat/completions", {**chat_body(f"Cycle {cycle}, stream {j}"), "stream": True, **long}
            async with c.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line:
                        return line
            return ""

        streams = [asyncio.ensure_future(first_chunk_then_close(j)) for j in range(PER_KIND)]
        # 3. Clients that give up while still queued, before any output: two streaming, two not.
        impatient = [
            asyncio.ensure_future(
                c.post(
                    "/v1/completions", json={"prompt": f"Cycle {cycle}, gives up {j}:", "stream": j % 2 == 0, **long}
                )
            )
            for j in range(GIVE_UP)
        ]
        # 4. One more request, queued too, aborted by rid while it waits.
        rid = f"case10-queued-{cycle}"
        queued = asyncio.ensure_future(
            c.post("/v1/completions", json={"prompt": f"Cycle {cycle}, queued:", **long}, headers={"x-request-id": rid})
        )
        assert await _poll(c, lambda v: v["num_queue_reqs"] == PER_KIND + GIVE_UP + 1, 120)
        for t in impatient:
            t.cancel()
        await asyncio.gather(*impatient, return_exceptions=True)
        assert await _poll(c, lambda v: v["num_queue_reqs"] == PER_KIND + 1, 60)  # gone from the queue
        assert (await c.post("/abort_request", json={"rid": rid})).status_code == 200
        r = await asyncio.wait_for(queued, 60)
        assert r.status_code != 500 and (r.status_code >= 400 or r.json()["choices"][0]["finish_reason"] == "abort")
        assert r.headers["x-request-id"] == rid
        assert (await c.get("/health")).status_code == 200

        # 5. The non-streaming clients give up after a short while (their connections close).
        await asyncio.sleep(1.0)
        for t in nonstream:
            t.cancel()
        await asyncio.gather(*nonstream, return_exceptions=True)
        firsts = await asyncio.wait_for(asyncio.gather(*streams), 300)
        assert all(f.startswith("data: {") for f in firsts), firsts
    return 2 * PER_KIND + GIVE_UP + 1


def test_case10_disconnects_free_everything(url):
    snapshots = []
    for cycle in range(CYCLES):
        aborted_before = metric(url, "num_aborted_requests_total")
        aborted = asyncio.run(_disconnect_cycle(url, cycle))
        assert wait_until(lambda: metric(url, "num_running_reqs") == 0 and metric(url, "num_queue_reqs") == 0, 120)
        want = aborted_before + aborted
        assert wait_until(lambda want=want: metric(url, "num_aborted_requests_total") == want, 60), (
            metric(url, "num_aborted_requests_total") - aborted_before,
            aborted,
        )
        # Every KV slot still used belongs to the radix cache and can be evicted: free + evictable == total.
        assert wait_until(lambda: metric(url, "num_used_tokens") == metric(url, "num_evictable_tokens"), 30)
        assert metric(url, "token_usage") == 0
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        # Dropping the cache returns the pool to empty: nothing leaked outside the tree either.
        assert httpx.post(url + "/flush_cache", timeout=60).status_code == 200
        assert wait_until(lambda: metric(url, "num_used_tokens") == 0, 30)
        snapshots.append((metric(url, "num_used_tokens"), metric(url, "max_total_num_tokens")))
        time.sleep(0.2)
    assert len(set(snapshots)) == 1, snapshots  # no growth across cycles


def test_case10_disconnect_before_the_stream_body_starts_aborts(tok):
    """A client gone by the time the SSE response starts (its disconnect lands in the same loop turn as the first
    output): the generation must still be aborted and its request id released, even though the stream body may be
    cancelled before its first iteration (an async generator closed before it starts never runs its ``finally``).
    Driven through raw ASGI with the scripted fake engine so the timing is exact."""
    from radixserve.engine.server.http import create_app

    from fake_engine import FakeEngine

    engine = FakeEngine(tok, delay_s=0.02)
    app = create_app(engine, manage_engine=False)
    body = json.dumps({"prompt": "hi", "max_tokens": 200, "stream": True}).encode()
    calls = 0

    async def receive() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        if calls == 2:  # the server's disconnect watcher while it waits for the first output: nothing yet
            await asyncio.Event().wait()
        return {"type": "http.disconnect"}  # gone for good, answered at once (as uvicorn does)

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def go() -> None:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
            "scheme": "http",
            "root_path": "",
        }
        await asyncio.wait_for(app(scope, receive, send), 30)
        await asyncio.sleep(0.3)  # several fake steps: a leaked generation would still be running

    asyncio.run(go())
    (req,) = engine.requests
    assert engine.aborted == [req.rid] and not engine.running
    assert not app.state.ctx.rids._live


def test_case10_abort_right_after_submit_is_not_lost(tok):
    """Regression (scheduler): an abort that arrived after the loop drained its inbox but before it read the abort
    queue was dropped (the request was not known yet), and the request then ran, unread, to max_tokens. This is
    the window of a client that disconnects at once. The loop now drains the inbox after reading the aborts: a
    request is always submitted before its own abort, so it is found. No forward runs (stub runner)."""
    from types import SimpleNamespace

    from radixserve.engine.io_struct import GenerateRequest, SamplingParams
    from radixserve.engine.scheduler.scheduler import Scheduler, SchedulerConfig

    outputs: list[Any] = []
    runner = SimpleNamespace(device="cpu", max_total_tokens=64)
    sched = Scheduler(runner, tok, SchedulerConfig(context_length=32), [2], outputs.extend)
    sched._recv(block=False)  # the loop has just drained its (empty) inbox ...
    sched.submit(GenerateRequest("r1", [1, 2, 3], SamplingParams(max_new_tokens=8)))  # ... then the client comes
    sched.abort("r1")  # ... and goes
    sched._process_aborts()
    sched._recv(block=False)
    assert not sched.waiting and not sched.running
    assert [(o.rid, o.finish_reason["type"]) for o in outputs] == [("r1", "abort")]
