"""docs/openai-compat.md stays true: every row of its tables is exercised against the real engine (a tiny random
checkpoint behind the real HTTP app), honoured and ignored parameters answer 200 and refused ones a 400 whose
``param`` names them; then what the implemented ones do (``logit_bias``, ``best_of``, ``parallel_tool_calls``),
directly and through the router, and that the official ``openai`` client sends nothing the engine refuses.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletionStreamOptionsParam

from radixserve.contracts.protocol import ChatCompletionRequest
from radixserve.engine.config import EngineArgs
from radixserve.engine.engine import Engine
from radixserve.engine.server.chat import RenderOptions, TemplateCaps, render_prompt
from radixserve.engine.server.http import create_app
from radixserve.router.app import create_app as router_app
from radixserve.router.config import RouterArgs

from fake_engine import FakeEngine, ServerThread, load_tokenizer, sse_payloads, wait_until
from tiny_model import write_tiny_model

pytestmark = pytest.mark.timeout(300)

DOC = Path(__file__).resolve().parents[1] / "docs" / "openai-compat.md"
MODEL = "tiny"
MSGS = [{"role": "user", "content": "Say hi."}]
BASE: dict[str, dict[str, Any]] = {
    "chat": {"model": MODEL, "messages": MSGS, "max_tokens": 2, "temperature": 0},
    "completions": {"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "temperature": 0},
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
TOOL2 = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def allowed(mode: str, *names: str) -> dict[str, Any]:
    """OpenAI's ``allowed_tools`` tool choice over ``names``."""
    tools = [{"type": "function", "function": {"name": n}} for n in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


AUDIO_PART = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

# Each row of the doc's tables → the request patches that exercise it and what each must get: 200, or the ``param``
# of its 400. A row marked "refused" needs a 400 case, "honoured" and "ignored" a 200 case.
Case = tuple[dict[str, Any], "int | str"]
SHARED: dict[str, list[Case]] = {
    "model": [({"model": MODEL}, 200), ({"model": "gpt-4o"}, "model")],
    "frequency_penalty": [({"frequency_penalty": 1.5}, 200), ({"frequency_penalty": 3}, "frequency_penalty")],
    "logit_bias": [({"logit_bias": {"42": 5, "7": -100}}, 200), ({"logit_bias": {"x": 1}}, "logit_bias")],
    "max_tokens": [({"max_tokens": 3}, 200), ({"max_tokens": -1}, "max_tokens")],
    "n": [({"n": 3, "temperature": 1.0}, 200), ({"n": None}, 200), ({"n": 0}, "n")],  # null was a 400
    "presence_penalty": [({"presence_penalty": -1}, 200), ({"presence_penalty": 2.5}, "presence_penalty")],
    "seed": [({"seed": 7, "temperature": 1.0}, 200), ({"seed": "7"}, "seed")],
    "stop": [({"stop": ["\n", "."]}, 200), ({"stop": [""]}, "stop")],
    "stream": [({"stream": True}, 200), ({"stream": None}, 200), ({"stream": "yes"}, "stream")],
    "stream_options.include_usage": [
        ({"stream": True, "stream_options": {"include_usage": True}}, 200),
        ({"stream": True, "stream_options": {"include_usage": None}}, 200),  # null: its default (was a 400)
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
    "stream_options.include_obfuscation": [
        ({"stream": True, "stream_options": {"include_obfuscation": False}}, 200),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, 200),
    ],
    "temperature": [({"temperature": 0.7}, 200), ({"temperature": -1}, "temperature")],
    "top_p": [({"top_p": 0.9, "temperature": 1.0}, 200), ({"top_p": 0}, "top_p")],
    "user": [({"user": "user-1234"}, 200)],
}
CHAT: dict[str, list[Case]] = {
    **SHARED,
    "messages": [
        ({"messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, *MSGS]}, 200),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
            "messages[0].content[0]",
        ),
    ],
    "audio": [({"audio": {"voice": "alloy", "format": "wav"}}, "audio")],
    "function_call": [({"function_call": "auto"}, "function_call")],
    "functions": [({"functions": [{"name": "f", "parameters": {}}]}, "functions")],
    "logprobs": [({"logprobs": True}, 200), ({"logprobs": None}, 200), ({"logprobs": 1}, "logprobs")],
    "max_completion_tokens": [
        ({"max_completion_tokens": 3}, 200),
        ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
    ],
    "metadata": [({"metadata": {"team": "a"}}, 200), ({"metadata": {"team": 1}}, "metadata.team")],
    "modalities": [({"modalities": ["text"]}, 200), ({"modalities": ["text", "audio"]}, "modalities")],
    "moderation": [({"moderation": {"model": "omni-moderation-latest"}}, "moderation")],
    "parallel_tool_calls": [({"tools": [TOOL], "parallel_tool_calls": False}, 200)],
    "prediction": [({"prediction": {"type": "content", "content": "hi"}}, "prediction")],
    "prompt_cache_key": [({"prompt_cache_key": "tenant-1"}, 200)],
    "prompt_cache_options": [({"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}}, 200)],
    "prompt_cache_retention": [({"prompt_cache_retention": "24h"}, 200)],
    "reasoning_effort": [({"reasoning_effort": "low"}, "reasoning_effort")],
    "response_format": [
        ({"response_format": {"type": "text"}}, 200),
        ({"response_format": {"type": "json_object"}}, 200),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}, 200),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
    "safety_identifier": [({"safety_identifier": "hash-of-user"}, 200)],
    "service_tier": [({"service_tier": "flex"}, 200), ({"service_tier": "gold"}, "service_tier")],
    "store": [({"store": False}, 200), ({"store": True}, "store")],
    "tool_choice": [
        ({"tools": [TOOL], "tool_choice": "none"}, 200),
        ({"tools": [TOOL], "tool_choice": "required"}, 200),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TOOL, TOOL2], "tool_choice": allowed("required", "get_time")}, 200),
        ({"tools": [TOOL], "tool_choice": allowed("auto", "nope")}, "tool_choice.allowed_tools.tools[0]"),
        ({"tools": [TOOL], "tool_choice": allowed("any", "get_weather")}, "tool_choice.allowed_tools.mode"),
        ({"tools": [TOOL], "tool_choice": {"type": "custom", "custom": {"name": "get_weather"}}}, "tool_choice"),
    ],
    "tools": [
        ({"tools": [TOOL]}, 200),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0]"),
    ],
    "top_logprobs": [({"logprobs": True, "top_logprobs": 3}, 200), ({"top_logprobs": 3}, "top_logprobs")],
    "verbosity": [({"verbosity": "low"}, "verbosity")],
    "web_search_options": [({"web_search_options": {}}, "web_search_options")],
}
COMPLETIONS: dict[str, list[Case]] = {
    **SHARED,
    "prompt": [
        ({"prompt": "Hi"}, 200),
        ({"prompt": ["Hi", "Bye"]}, 200),
        ({"prompt": [1, 2, 3]}, 200),
        ({"prompt": [[1, 2], [3]]}, 200),
        ({"prompt": [5, 10**7]}, "prompt"),
    ],
    "best_of": [
        ({"best_of": 3, "n": 2, "temperature": 1.0}, 200),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
    ],
    "echo": [({"echo": True, "logprobs": 1}, 200), ({"echo": None}, 200)],
    "logprobs": [({"logprobs": 2}, 200), ({"logprobs": 21}, "logprobs")],
    "suffix": [({"suffix": ""}, 200), ({"suffix": " the end."}, "suffix")],
}
EXTENSIONS: dict[str, list[Case]] = {
    "top_k": [({"top_k": 5, "temperature": 1.0}, 200), ({"top_k": -2}, "top_k")],
    "min_p": [({"min_p": 0.1, "temperature": 1.0}, 200), ({"min_p": 2}, "min_p")],
    "repetition_penalty": [({"repetition_penalty": 1.3}, 200), ({"repetition_penalty": 0}, "repetition_penalty")],
    "stop_token_ids": [({"stop_token_ids": [2]}, 200), ({"stop_token_ids": [10**7]}, "stop_token_ids")],
    "ignore_eos": [({"ignore_eos": True}, 200), ({"ignore_eos": None}, 200)],
    "skip_special_tokens": [({"skip_special_tokens": False}, 200)],
    "no_stop_trim": [({"no_stop_trim": True, "stop": "."}, 200)],
    "regex": [({"regex": "[ab]+"}, 200), ({"regex": "[ab"}, "regex")],
    "ebnf": [({"ebnf": 'root ::= "yes" | "no"'}, 200)],
    "json_schema": [({"json_schema": SCHEMA}, 200), ({"json_schema": 5}, "json_schema")],
    "cache_salt": [({"cache_salt": "tenant-a"}, 200)],
    "min_tokens": [
        ({"min_tokens": 2}, 200),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": "2"}, "min_tokens"),
        ({"min_tokens": None}, 200),  # null is its default (new-user try: a 400)
    ],
}
# Chat only: the completions endpoint has no template.
CHAT_EXTENSIONS: dict[str, list[Case]] = {
    "chat_template_kwargs": [
        ({"chat_template_kwargs": {"enable_thinking": False}}, 200),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ],
    "(any other key)": [
        ({"frobnicate": 1}, "frobnicate"),
        ({"temprature": 0.5}, "temprature"),
        ({"stream": True, "stream_options": {"include_usage": True, "usage": True}}, "stream_options.usage"),
    ],
}
COMPLETIONS_EXTENSIONS: dict[str, list[Case]] = {
    "response_format (completions)": [({"response_format": {"type": "json_object"}}, 200)]
}
SECTIONS = {
    "POST /v1/chat/completions": CHAT,
    "POST /v1/completions": COMPLETIONS,
    "Extensions (SGLang and vLLM)": {**EXTENSIONS, **CHAT_EXTENSIONS, **COMPLETIONS_EXTENSIONS},
}


def doc_rows() -> dict[str, dict[str, str]]:
    """Each table of the doc by its section title: row key (first cell without backticks) → status word."""
    text = DOC.read_text(encoding="utf-8")
    tables: dict[str, dict[str, str]] = {}
    for m in re.finditer(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", text, re.M | re.S):
        rows: dict[str, str] = {}
        for line in m.group(2).splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not line.startswith("|") or cells[0] in ("Parameter", "---"):
                continue
            key = cells[0].replace("`", "")
            assert key not in rows, f"{m.group(1)}: row {key} twice"
            rows[key] = cells[1]
        tables[m.group(1)] = rows
    return tables


# ----------------------------------------------------------------------------------------------------- doc ↔ tests


def test_doc_tables_match_the_cases():
    tables = doc_rows()
    assert set(tables) == set(SECTIONS)
    for title, cases in SECTIONS.items():
        rows = tables[title]
        assert set(rows) == set(cases), f"{title}: rows without a case or cases without a row"
        for key, status in rows.items():
            assert status in ("honoured", "ignored", "refused"), (key, status)
            wants = {expect for _, expect in cases[key]}
            if status == "refused":
                assert any(isinstance(w, str) for w in wants), f"{key}: no case shows the 400"
            else:
                assert 200 in wants, f"{key}: no case shows it accepted"


SDK_CREATE = {
    "chat": openai.resources.chat.completions.Completions,
    "completions": openai.resources.completions.Completions,
}
SDK_OPTIONS = {"self", "extra_headers", "extra_query", "extra_body", "timeout", "stream_options"}  # not parameters


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_doc_lists_every_parameter_of_the_openai_sdk(endpoint):
    """The installed SDK's ``create`` is OpenAI's current reference: each of its parameters has a row (the
    ``stream_options`` fields as ``stream_options.<field>``)."""
    params = set(inspect.signature(SDK_CREATE[endpoint].create).parameters) - SDK_OPTIONS
    params |= {f"stream_options.{f}" for f in ChatCompletionStreamOptionsParam.__annotations__}
    rows = doc_rows()["POST /v1/chat/completions" if endpoint == "chat" else "POST /v1/completions"]
    assert params <= set(rows), sorted(params - set(rows))


# ----------------------------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-compat"))


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Engine]:
    args = EngineArgs(
        model_path=tiny_model,
        served_model_name=MODEL,
        device="cpu",
        dtype="float32",
        max_total_tokens=4096,
        context_length=512,
        num_threads=1,
        cpu_omp_threads_bind="nobind",
    )
    eng = Engine(args)
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine_url(engine: Engine) -> Iterator[str]:
    with ServerThread(create_app(engine, manage_engine=False)) as url:
        yield url


@pytest.fixture(scope="module")
def router_url(engine_url: str) -> Iterator[str]:
    with ServerThread(router_app(RouterArgs(worker_urls=[engine_url], health_interval_s=0.5))) as url:
        assert wait_until(lambda: httpx.get(url + "/health").json()["routable_workers"] >= 1, 30)
        yield url


def post(url: str, endpoint: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + PATHS[endpoint], json=body, timeout=60)


def check(r: httpx.Response, expect: int | str, stream: bool) -> None:
    if expect == 200:
        assert r.status_code == 200, r.text
        if stream:
            sse_payloads(r.text)
        return
    assert r.status_code == (404 if expect == "model" else 400), r.text  # an unknown model is OpenAI's 404
    err = r.json()["error"]
    assert err["param"] == expect, err


def all_cases() -> list[Any]:
    """``(endpoint, patch, expect)`` of every case, the extensions on both endpoints."""
    tables = [("chat", CHAT), ("completions", COMPLETIONS), ("chat", EXTENSIONS), ("completions", EXTENSIONS)]
    tables += [("chat", CHAT_EXTENSIONS), ("completions", COMPLETIONS_EXTENSIONS)]
    return [
        pytest.param(endpoint, patch, expect, id=f"{endpoint}-{key}-{i}")
        for endpoint, table in tables
        for key, cases in table.items()
        for i, (patch, expect) in enumerate(cases)
    ]


@pytest.mark.parametrize("endpoint, patch, expect", all_cases())
def test_every_row(engine_url, endpoint, patch, expect):
    body = {**BASE[endpoint], **patch}
    check(post(engine_url, endpoint, body), expect, body.get("stream") is True)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_unknown_keys_are_all_named(engine_url, endpoint):
    r = post(engine_url, endpoint, {**BASE[endpoint], "foo": 1, "bar": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "foo"
    assert "Unrecognized request argument supplied: foo, bar" in r.json()["error"]["message"]


# ----------------------------------------------------------------------------------------------------- logit_bias


def generate(url: str, body: dict[str, Any]) -> Any:
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(url: str, prompt: str, **sp: Any) -> list[int]:
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, **sp}
    return generate(url, {"text": prompt, "sampling_params": params})["output_ids"]


def test_logit_bias_bans_and_forces(engine_url):
    base = greedy(engine_url, "The weather today")
    banned = greedy(engine_url, "The weather today", logit_bias={str(base[0]): -100})
    assert banned[0] != base[0] and base[0] not in banned
    assert greedy(engine_url, "The weather today", logit_bias={"1234": 100}) == [1234] * 6
    sampled = greedy(engine_url, "The weather today", logit_bias={"1234": 100, "99": 100}, temperature=1.5, seed=1)
    assert set(sampled) <= {1234, 99}
    # A small bias only shifts the logit: its value matters, and it is not a ban.
    assert greedy(engine_url, "The weather today", logit_bias={str(base[0]): -0.0001}) == base


def test_logit_bias_in_a_mixed_batch_with_samples(engine_url):
    """One /generate batch: a prompt without bias next to one with, and ``n`` samples: only the biased rows move."""
    prompts = ["The weather today", "Once upon a time"]
    plain = [greedy(engine_url, p) for p in prompts]
    forced = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "n": 3, "logit_bias": {"500": 100}}
    body = {"text": prompts, "sampling_params": [{"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}, forced]}
    out = generate(engine_url, body)
    assert out[0]["output_ids"] == plain[0]
    assert [o["output_ids"] for o in out[1:]] == [[500] * 6] * 3


def test_logit_bias_inside_a_grammar(engine_url, engine):
    """The grammar's mask wins over a +100 bias, and a -100 ban works inside it: digits 1-9 banned under
    ``[0-9]{3}`` leave ``000``; a letter forced under it still gives digits."""
    tok = engine.tokenizer
    digits = {d: tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    ban = {str(digits[d]): -100 for d in range(1, 10)}
    for url_body in ({"regex": "[0-9]{3}", "logit_bias": ban}, {"regex": "[0-9]{3}", "logit_bias": {"64": 100}}):
        r = post(engine_url, "completions", {**BASE["completions"], "max_tokens": 8, **url_body})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert re.fullmatch("[0-9]{3}", text), text
        if url_body["logit_bias"] is ban:
            assert text == "000"


@pytest.mark.parametrize(
    "bias",
    [
        {"abc": 1},
        {"-1": 1},
        {"01": 1},
        {" 1": 1},
        {"1e3": 1},
        {"49152": 1},  # the vocabulary is 49152 tokens
        {"1": 100.5},
        {"1": -101},
        {"1": "5"},
        {"1": True},
        {"1": None},
        {str(i): 1 for i in range(1025)},
        [1, 2],
    ],
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_logit_bias_invalid(engine_url, endpoint, bias):
    r = post(engine_url, endpoint, {**BASE[endpoint], "logit_bias": bias})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias", r.json()


def test_logit_bias_invalid_on_generate(engine_url):
    r = httpx.post(engine_url + "/generate", json={"text": "hi", "sampling_params": {"logit_bias": {"x": 1}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_logit_bias_through_the_router_with_the_openai_client(engine, engine_url, router_url):
    """The router passes logit_bias through unchanged: the same forced tokens as the engine, official client (which
    sends the dict's int keys as JSON strings)."""
    results = []
    for url in (engine_url, router_url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        chat = client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=4, temperature=0, logit_bias={1234: 100}, logprobs=True
        )
        comp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logit_bias={1234: 100})
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        results.append((chat.choices[0].message.content, comp.choices[0].text))
    forced = engine.tokenizer.decode([1234] * 4)
    assert results == [(forced, forced)] * 2
    with pytest.raises(openai.BadRequestError) as e:
        openai.OpenAI(base_url=router_url + "/v1", api_key="x").chat.completions.create(
            model=MODEL, messages=MSGS, logit_bias={"x": 1}
        )
    assert e.value.param == "logit_bias"


def test_router_streams_keep_the_parameters(engine, router_url):
    """A stream through the router is re-encoded (it asks for the usage chunk): logit_bias still forces, and an
    unknown key is still the engine's 400."""
    body = {**BASE["chat"], "max_tokens": 3, "stream": True, "logit_bias": {"1234": 100}}
    r = post(router_url, "chat", body)
    assert r.status_code == 200, r.text
    text = "".join(ch["delta"].get("content") or "" for p in sse_payloads(r.text) for ch in p["choices"])
    assert text == engine.tokenizer.decode([1234] * 3)
    r = post(router_url, "chat", {**body, "frobnicate": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"


def test_openai_client_sends_nothing_refused(router_url):
    """Every accepted (ignored) OpenAI field, set through the official client: 200."""
    client = openai.OpenAI(base_url=router_url + "/v1", api_key="x")
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_completion_tokens=2,
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        user="u",
        safety_identifier="s",
        prompt_cache_key="p",
        prompt_cache_retention="24h",
        modalities=["text"],
        parallel_tool_calls=True,
        tools=[TOOL],  # type: ignore[list-item]
        seed=1,
        extra_body={"top_k": 3, "cache_salt": "t"},
    )
    assert chat.choices[0].finish_reason in ("length", "stop", "tool_calls")
    stream = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=2, stream=True, stream_options={"include_usage": True}, user="u"
    )
    assert [c for c in stream if c.usage is not None]


# ----------------------------------------------------------------------------------------------------- best_of


def test_best_of_returns_the_best_candidates(engine_url):
    """Sample ``i`` of a seeded request uses ``seed + i``: ``best_of=4, n=4`` shows every candidate, so ``n=2``
    must return the two of highest mean token logprob, best first, and count all four in the usage."""
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 1.0, "seed": 11, "logprobs": 0}
    every = post(engine_url, "completions", {**body, "n": 4}).json()

    def mean(choice: dict[str, Any]) -> float:
        lps = choice["logprobs"]["token_logprobs"]
        return sum(lps) / len(lps)

    ranked = sorted(every["choices"], key=lambda c: (-mean(c), c["index"]))
    best = post(engine_url, "completions", {**body, "n": 2, "best_of": 4}).json()
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]
    # Without logprobs asked, none are returned (they were only used to rank).
    quiet = post(engine_url, "completions", {**body, "n": 2, "best_of": 4, "logprobs": None}).json()
    assert [c["text"] for c in quiet["choices"]] == [c["text"] for c in ranked[:2]]
    assert all(c["logprobs"] is None for c in quiet["choices"])


def test_best_of_with_several_prompts_and_echo(engine_url):
    body = {"model": MODEL, "prompt": ["Hi", "Bye"], "max_tokens": 2, "temperature": 1.0, "seed": 3}
    r = post(engine_url, "completions", {**body, "n": 1, "best_of": 3, "echo": True})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 2 and texts[0].startswith("Hi") and texts[1].startswith("Bye")
    assert r.json()["usage"]["completion_tokens"] == 2 * 3 * 2


# ----------------------------------------------------------------------------------------------------- chat template


def test_chat_template_kwargs_reach_the_template():
    tok = load_tokenizer()
    tok.chat_template = "{% if shout %}LOUD {% endif %}{{ messages[0]['content'] }}"
    req = ChatCompletionRequest.model_validate({"messages": MSGS, "chat_template_kwargs": {"shout": True}})
    assert render_prompt(tok, req, RenderOptions(caps=TemplateCaps())) == "LOUD Say hi."
    req = ChatCompletionRequest.model_validate({"messages": MSGS})
    assert render_prompt(tok, req, RenderOptions(caps=TemplateCaps())) == "Say hi."


# ----------------------------------------------------------------------------------------------------- tool calls


def two_calls_engine(tokenizer: Any) -> FakeEngine:
    engine = FakeEngine(tokenizer)
    call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    engine.script_ids = tokenizer.encode(call + call)
    return engine


def test_allowed_tools_offer_and_constrain_only_those(engine):
    """``allowed_tools``: only the listed tools are shown to the model and callable; ``required`` constrains the
    reply to a call of one of them, ``auto`` leaves a call to another tool as text."""
    fake = two_calls_engine(engine.tokenizer)  # replies with two calls to get_weather
    client = TestClient(create_app(fake, manage_engine=False))
    body: dict[str, Any] = {"messages": MSGS, "tools": [TOOL, TOOL2], "max_tokens": 200}
    r = client.post("/v1/chat/completions", json={**body, "tool_choice": allowed("auto", "get_time")})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert "tool_calls" not in message and "get_weather" in message["content"]
    prompt = engine.tokenizer.decode(fake.requests[0].input_ids)
    assert "get_time" in prompt and "get_weather" not in prompt
    r = client.post("/v1/chat/completions", json={**body, "tool_choice": allowed("required", "get_time")})
    assert r.status_code == 200, r.text
    schema = json.loads(fake.requests[1].sampling_params.json_schema)
    assert schema["properties"]["name"] == {"const": "get_time"}
    r = client.post("/v1/chat/completions", json={**body, "tool_choice": allowed("auto", "get_weather", "get_time")})
    assert len(r.json()["choices"][0]["message"]["tool_calls"]) == 2


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel, calls", [(None, 2), (True, 2), (False, 1)])
def test_parallel_tool_calls(engine, parallel, calls, stream):
    fake = two_calls_engine(engine.tokenizer)
    client = TestClient(create_app(fake, manage_engine=False))
    body: dict[str, Any] = {"messages": MSGS, "tools": [TOOL], "max_tokens": 200, "stream": stream}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        got = [tc for p in sse_payloads(r.text) for ch in p["choices"] for tc in (ch["delta"].get("tool_calls") or [])]
    else:
        got = r.json()["choices"][0]["message"]["tool_calls"]
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in got] == [{}] * calls


def test_min_tokens_holds_off_the_end_tokens_and_stop_strings(engine_url, engine):
    """``min_tokens`` (``min_new_tokens`` natively): an end token forced by logit_bias comes only once the minimum is
    reached; so does a forced stop token; a stop string in the early text does not end it; without it, the forced
    end token ends the output at once. A grammar row keeps ending where its grammar ends."""
    eos = sorted(engine.scheduler.eos_token_ids)[0]
    forced_eos = {"max_new_tokens": 20, "temperature": 0, "logit_bias": {str(eos): 100}}
    assert generate(engine_url, {"text": "Hi", "sampling_params": forced_eos})["meta_info"]["completion_tokens"] <= 1
    out = generate(engine_url, {"text": "Hi", "sampling_params": {**forced_eos, "min_new_tokens": 5}})
    assert eos not in out["output_ids"][:5] and out["meta_info"]["finish_reason"]["type"] == "stop"
    assert len(out["output_ids"]) <= 6  # the end token comes right after the minimum

    r = post(
        engine_url,
        "completions",
        {**BASE["completions"], "max_tokens": 20, "min_tokens": 7, "stop_token_ids": [700], "logit_bias": {"700": 100}},
    )
    body = r.json()
    assert r.status_code == 200 and body["choices"][0]["finish_reason"] == "stop", body
    assert body["usage"]["completion_tokens"] in (7, 8)  # 7 tokens, then the stop token (counted or not)

    # A stop string in the text of the first tokens does not end it: the same greedy output, cut only after.
    ids = greedy(engine_url, "The weather today", max_new_tokens=8)
    first = engine.tokenizer.decode(ids[:1])
    assert first.strip(), "the first token must have text to stop on"
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "stop": [first]}
    cut = generate(engine_url, {"text": "The weather today", "sampling_params": params})
    held = generate(engine_url, {"text": "The weather today", "sampling_params": {**params, "min_new_tokens": 8}})
    assert cut["meta_info"]["completion_tokens"] == 1 and cut["text"] == ""
    assert held["output_ids"] == ids

    grammar = {"max_new_tokens": 20, "temperature": 0, "regex": "ab", "min_new_tokens": 10}
    assert generate(engine_url, {"text": "Hi", "sampling_params": grammar})["text"] == "ab"


def test_min_new_tokens_over_max_new_tokens_is_a_400_on_generate(engine_url):
    # New-user try: {"max_new_tokens": 3, "min_new_tokens": 5} answered 200 with 3 tokens (the minimum quietly unmet).
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 3, "min_new_tokens": 5}}
    r = httpx.post(engine_url + "/generate", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_new_tokens", r.text
    body["sampling_params"]["min_new_tokens"] = 3
    assert generate(engine_url, body)["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "contnet": "Hi"}, {"role": "system"}])
def test_a_user_or_system_message_without_content_is_a_400(engine_url, message):
    # New-user try: {"role": "user"} (or a misspelled "contnet") answered 200, rendered as an empty turn.
    body = {**BASE["chat"], "messages": [message]}
    r = post(engine_url, "chat", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
