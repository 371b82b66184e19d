"""Constrained decoding (xgrammar): the bitmask kernel, the grammar backend, and the engine on the real model.

The engine tests use one fp32 engine (greedy, deterministic) for the module, also served over HTTP for the streaming
and error-path checks. Every constrained output must parse / fully match; invalid grammars are 400s raised before the
request reaches the scheduler, twice (the second from the failure cache), and the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, SamplingParams
from radixserve.engine.sampling.sampler import apply_token_bitmask

from conftest import MODEL_DIR, requires_model

V = 49152
WORDS = V // 32


# ------------------------------------------------------------------------------------------------- bitmask kernel


def _reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Plain unpack of xgrammar's layout: bit j of word w allows token 32 w + j."""
    out = logits.clone()
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, : logits.shape[1]]
    for r in rows:
        out[r, torch.from_numpy(bits[r] == 0)] = float("-inf")
    return out


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 4),
    density=st.sampled_from([0.0, 0.001, 0.3, 0.7, 0.999, 1.0]),
    seed=st.integers(0, 2**16),
    vocab_cut=st.sampled_from([0, 5]),
)
def test_apply_token_bitmask_matches_unpacked_reference(batch, density, seed, vocab_cut):
    g = torch.Generator().manual_seed(seed)
    vocab = V - vocab_cut  # logits narrower than the mask's last word
    allowed = torch.rand(batch, WORDS * 32, generator=g) < density
    packed = np.packbits(allowed.numpy(), axis=-1, bitorder="little").view(np.int32)
    bitmask = torch.from_numpy(packed.copy())
    logits = torch.randn(batch, vocab, generator=g)
    rows = [r for r in range(batch) if r % 2 == 0 or batch == 1]
    expected = _reference_mask(logits, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_dense_bitmask_path_for_accelerators_matches_reference():
    from radixserve.engine.sampling.sampler import _apply_token_bitmask_dense

    g = torch.Generator().manual_seed(1)
    allowed = torch.rand(3, WORDS * 32, generator=g) < 0.01
    bitmask = torch.from_numpy(np.packbits(allowed.numpy(), axis=-1, bitorder="little").view(np.int32).copy())
    logits = torch.randn(3, V - 3, generator=g)
    expected = _reference_mask(logits, bitmask, [0, 2])
    _apply_token_bitmask_dense(logits, bitmask, [0, 2])  # what CUDA runs, here on the CPU
    assert torch.equal(logits, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_token_bitmask_on_cuda():
    g = torch.Generator().manual_seed(2)
    allowed = torch.rand(2, WORDS * 32, generator=g) < 0.3
    bitmask = torch.from_numpy(np.packbits(allowed.numpy(), axis=-1, bitorder="little").view(np.int32).copy())
    logits = torch.randn(2, V, generator=g)
    expected = _reference_mask(logits, bitmask, [1])
    on_gpu = logits.cuda()
    apply_token_bitmask(on_gpu, bitmask, [1])
    assert torch.equal(on_gpu.cpu(), expected)


def test_apply_token_bitmask_agrees_with_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    for density in (0.0005, 0.5, 0.9995):
        allowed = torch.rand(3, V, generator=g) < density
        bitmask = torch.from_numpy(np.packbits(allowed.numpy(), axis=-1, bitorder="little").view(np.int32).copy())
        ours, theirs = torch.randn(3, V, generator=g), None
        theirs = ours.clone()
        apply_token_bitmask(ours, bitmask, [0, 1, 2])
        xgr.apply_token_bitmask_inplace(theirs, bitmask)
        assert torch.equal(ours, theirs)


def test_apply_token_bitmask_rejects_non_float32_cpu_logits():
    with pytest.raises(ValueError):
        apply_token_bitmask(torch.zeros(1, V, dtype=torch.bfloat16), torch.zeros(1, WORDS, dtype=torch.int32), [0])


# ------------------------------------------------------------------------------------------------- validation


def test_at_most_one_grammar_field():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(regex="a", ebnf='root ::= "a"').validate(V)
    assert e.value.status_code == 400 and "at most one" in e.value.message
    SamplingParams(regex="a").validate(V)  # no interim "not supported" refusal
    assert SamplingParams(json_schema="{}").grammar_key() == ("json_schema", "{}")
    assert SamplingParams().grammar_key() is None


# ------------------------------------------------------------------------------------------------- real model

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


S = {"type": "string", "maxLength": 60}
# 22 prompts: nested objects, arrays, enums, bounded integers and numbers, booleans, patterns, optional fields, one in
# Chinese and one asking for a table.
SCHEMA_PROMPTS: list[tuple[str, dict[str, Any]]] = [
    ("Describe a person.", PERSON),
    ("Invent a character for a fantasy novel.", PERSON),
    ("请用JSON描述一个人的姓名和年龄。", PERSON),
    (
        "Make a table of three countries and their capitals.",
        _obj({"rows": {"type": "array", "items": _obj({"country": S, "capital": S}), "minItems": 1, "maxItems": 3}}),
    ),
    (
        "Give me a user profile with a home address.",
        _obj(
            {
                "user": _obj({"name": S, "email": S}),
                "address": _obj({"city": S, "zip": {"type": "string", "pattern": "[0-9]{5}"}}),
            }
        ),
    ),
    (
        "What is the weather like today?",
        _obj(
            {
                "condition": {"enum": ["sunny", "rainy", "cloudy", "snowy"]},
                "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
            }
        ),
    ),
    (
        "Rate the movie Inception from 1 to 10.",
        _obj({"movie": S, "rating": {"type": "integer", "minimum": 1, "maximum": 10}}),
    ),
    ("List three fruits.", _obj({"fruits": {"type": "array", "items": S, "minItems": 3, "maxItems": 3}})),
    ("Is the sky blue? Answer with a reason.", _obj({"answer": {"type": "boolean"}, "reason": S})),
    ("How much does a cup of coffee cost?", _obj({"item": S, "price": {"type": "number", "minimum": 0}})),
    ("Pick a primary color.", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    (
        "Recommend a classic book.",
        _obj({"title": S, "author": S, "year": {"type": "integer", "minimum": 1000, "maximum": 2025}}),
    ),
    (
        "List the first two planets and their positions from the sun.",
        _obj(
            {
                "planets": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": _obj({"name": S, "position": {"type": "integer", "minimum": 1, "maximum": 8}}),
                }
            }
        ),
    ),
    (
        "Create a to-do item for tomorrow.",
        _obj({"task": S, "priority": {"enum": ["low", "medium", "high"]}, "done": {"type": "boolean"}}),
    ),
    (
        "Describe a dog.",
        _obj({"breed": S, "age": {"type": "integer", "minimum": 0, "maximum": 30}, "vaccinated": {"type": "boolean"}}),
    ),
    (
        "Give the coordinates of Paris.",
        _obj(
            {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
            }
        ),
    ),
    ("Write a short product review.", _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "title": S})),
    ("Convert 5 kilometers to miles.", _obj({"km": {"type": "number"}, "miles": {"type": "number"}})),
    (
        "Describe an upcoming concert.",
        _obj(
            {
                "event": _obj({"name": S, "date": {"type": "string", "pattern": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}}),
                "attendees": {"type": "integer", "minimum": 0},
            }
        ),
    ),
    (
        "List the ingredients of a pancake recipe.",
        _obj({"recipe": S, "ingredients": {"type": "array", "items": S, "minItems": 1, "maxItems": 5}}),
    ),
    (
        "Classify the sentiment of: I love this!",
        _obj(
            {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    (
        "Describe a city.",
        _obj({"name": S, "population": {"type": "integer", "minimum": 0}, "country": S}, required=["name"]),
    ),
]

REGEXES = {
    "date": ("When was the Eiffel Tower finished? Answer with a date (YYYY-MM-DD).", r"\d{4}-(0[1-9]|1[0-2])-\d{2}"),
    "ipv4": ("What is the IP address of localhost?", r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"),
    "email": ("Give an example email address.", r"[a-z0-9._]{1,20}@[a-z0-9]{1,20}\.(com|org|net)"),
}

BAD_GRAMMARS = [
    ("json_schema", json.dumps({"type": "object", "properties": {"foo": "bar"}}), "bar"),
    ("json_schema", json.dumps({"type": "array", "items": 5}), "items"),
    ("json_schema", json.dumps({"$ref": "#/definitions/missing"}), "definitions"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "object or boolean"),
    ("regex", r"(a+)\1", "Backreference"),
    ("regex", "[a-", "Unclosed"),
    ("ebnf", 'root ::= "a', "string literal"),
    ("ebnf", 'start ::= "a"', "root"),
]


@pytest.fixture(scope="module")
def served():
    """``(engine, base_url)``: one real fp32 engine, also behind uvicorn. Tests using it are marked slow."""
    if not __import__("os").path.exists(MODEL_DIR + "/config.json"):
        pytest.skip("demo model not converted")
    from radixserve.engine.config import EngineArgs
    from radixserve.engine.engine import Engine
    from radixserve.engine.server.http import create_app

    from fake_engine import ServerThread, wait_until

    engine = Engine(
        EngineArgs(model_path=MODEL_DIR, dtype="float32", context_length=2048, num_threads=2, max_total_tokens=16384)
    )
    with ServerThread(create_app(engine)) as url:
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 200, 300)
        yield engine, url


@pytest.fixture(scope="module")
def engine(served):
    return served[0]


@pytest.fixture(scope="module")
def url(served):
    return served[1]


def chat_ids(engine: Any, text: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def _collect(engine: Any, ids: list[int], **params: Any) -> dict[int, dict[str, Any]]:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_new_tokens", 160)
    req = GenerateRequest(uuid.uuid4().hex, ids, SamplingParams(**params))
    results: dict[int, dict[str, Any]] = {}
    async for out in engine.generate(req):
        r = results.setdefault(out.index, {"ids": [], "text": "", "finish": None, "cached": 0, "deltas": 0})
        r["ids"] += out.token_ids
        r["text"] += out.text
        r["cached"] = out.cached_tokens
        r["deltas"] += 1
        if out.finished:
            r["finish"] = out.finish_reason
    return results


def run(engine: Any, ids: list[int], **params: Any) -> dict[int, dict[str, Any]]:
    return asyncio.run(_collect(engine, ids, **params))


def run_many(engine: Any, jobs: list[tuple[list[int], dict[str, Any]]]) -> list[dict[int, dict[str, Any]]]:
    async def go():
        return await asyncio.gather(*[_collect(engine, ids, **p) for ids, p in jobs])

    return asyncio.run(go())


def counter(engine: Any, name: str) -> float:
    return getattr(engine.metrics, name)._value.get()


def assert_idle(engine: Any) -> None:
    sched = engine.scheduler

    def check():
        assert not sched.running and not sched.waiting and sched.chunked_req is None
        assert sched.cache.protected_size() == 0
        assert sched.allocator.available() + sched.cache.evictable_size() == sched.allocator.size

    sched.call(check)
    assert engine._grammar_queue == 0


def assert_valid_json(text: str, schema: dict[str, Any], finish: dict[str, Any]) -> Any:
    assert finish == {"type": "stop", "matched": 2}, (finish, text)
    value = json.loads(text)
    jsonschema.validate(value, schema)
    assert "\n" not in text and not text.startswith(" ")  # compact: no free whitespace
    return value


@requires_model
@pytest.mark.slow
def test_json_schema_prompts_all_parse_and_validate(engine):
    before = counter(engine, "num_constrained_requests_total")
    jobs = [(chat_ids(engine, p), {"json_schema": json.dumps(s)}) for p, s in SCHEMA_PROMPTS]
    outs = run_many(engine, jobs)
    for (_, schema), out in zip(SCHEMA_PROMPTS, outs):
        assert_valid_json(out[0]["text"], schema, out[0]["finish"])
    assert counter(engine, "num_constrained_requests_total") - before == len(SCHEMA_PROMPTS)
    assert_idle(engine)


@requires_model
@pytest.mark.slow
def test_json_object_parses(engine):
    out = run(engine, chat_ids(engine, "Give me any JSON object describing a car."), json_schema='{"type": "object"}')
    assert isinstance(json.loads(out[0]["text"]), dict) and out[0]["finish"]["type"] == "stop"


@requires_model
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REGEXES))
def test_regex_fully_matches(engine, name):
    prompt, regex = REGEXES[name]
    out = run(engine, chat_ids(engine, prompt), regex=regex, max_new_tokens=48)
    assert re.fullmatch(regex, out[0]["text"]), out[0]["text"]
    assert out[0]["finish"] == {"type": "stop", "matched": 2}


@requires_model
@pytest.mark.slow
def test_ebnf(engine):
    grammar = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,40}'
    out = run(engine, chat_ids(engine, "Is water wet?"), ebnf=grammar, max_new_tokens=60)
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,40}", out[0]["text"]), out[0]["text"]
    assert out[0]["finish"]["type"] == "stop"


@requires_model
@pytest.mark.slow
def test_empty_regex_gives_an_empty_completion(engine):
    out = run(engine, chat_ids(engine, "Say something."), regex="", max_new_tokens=16)
    assert out[0]["text"] == "" and out[0]["finish"] == {"type": "stop", "matched": 2}
    assert out[0]["ids"] == [2]  # only eos was allowed


@requires_model
@pytest.mark.slow
def test_ignore_eos_still_stops_when_the_grammar_ends(engine):
    out = run(engine, chat_ids(engine, "Yes or no?"), ebnf='root ::= "yes" | "no"', ignore_eos=True)
    assert out[0]["text"] in ("yes", "no") and out[0]["finish"]["type"] == "stop"


@requires_model
@pytest.mark.slow
def test_invalid_grammars_are_400_twice_and_the_engine_keeps_serving(engine):
    for kind, text, needle in BAD_GRAMMARS:
        for attempt in range(2):
            hits = counter(engine, "grammar_cache_hits_total")
            with pytest.raises(InvalidRequestError) as e:
                run(engine, chat_ids(engine, "JSON please"), **{kind: text})
            assert e.value.status_code == 400 and e.value.param == kind
            assert needle in e.value.message and kind in e.value.message, e.value.message
            if attempt == 1:
                assert counter(engine, "grammar_cache_hits_total") == hits + 1  # the cached failure
    assert engine.is_healthy()
    out = run(engine, chat_ids(engine, "Describe a person."), json_schema=json.dumps(PERSON))
    assert_valid_json(out[0]["text"], PERSON, out[0]["finish"])
    assert_idle(engine)


@requires_model
@pytest.mark.slow
def test_parallel_samples_each_follow_the_schema(engine):
    # Bounded name: at temperature 1 an unbounded string may run to max_new_tokens, which is not what this checks.
    person = _obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}})
    out = run(
        engine, chat_ids(engine, "Describe a person."), json_schema=json.dumps(person), n=3, temperature=1.0, seed=11
    )
    assert sorted(out) == [0, 1, 2]
    for r in out.values():
        assert_valid_json(r["text"], person, r["finish"])
    assert len({r["text"] for r in out.values()}) > 1  # independent matchers, different samples
    assert_idle(engine)


@requires_model
@pytest.mark.slow
def test_stop_string_with_schema(engine):
    ids = chat_ids(engine, "Describe a person.")
    full = run(engine, ids, json_schema=json.dumps(PERSON))[0]
    assert '"age"' in full["text"]
    cut = run(engine, ids, json_schema=json.dumps(PERSON), stop=['"age"'])[0]
    assert cut["finish"] == {"type": "stop", "matched": '"age"'}
    assert cut["text"] == full["text"][: full["text"].index('"age"')]


@requires_model
@pytest.mark.slow
def test_constrained_after_a_cached_prefix(engine):
    ids = chat_ids(engine, "Describe a person who lives in Lisbon and works as a baker.")
    plain = run(engine, ids, max_new_tokens=8)[0]
    assert plain["finish"] is not None
    out = run(engine, ids, json_schema=json.dumps(PERSON))[0]
    assert out["cached"] > 0  # the prompt came from the radix cache; the matcher still started fresh
    assert_valid_json(out["text"], PERSON, out["finish"])
    again = run(engine, ids, json_schema=json.dumps(PERSON))[0]
    assert again["text"] == out["text"]  # cached prompt + cached grammar: same greedy output


@requires_model
@pytest.mark.slow
def test_abort_mid_generation_frees_everything(engine):
    async def go():
        req = GenerateRequest(
            uuid.uuid4().hex,
            chat_ids(engine, "Describe a person."),
            SamplingParams(temperature=0.0, max_new_tokens=64, json_schema=json.dumps(PERSON)),
        )
        agen = engine.generate(req)
        async for _ in agen:
            break
        await agen.aclose()

    aborted = counter(engine, "num_aborted_requests_total")
    asyncio.run(go())
    from fake_engine import wait_until

    assert wait_until(lambda: counter(engine, "num_aborted_requests_total") == aborted + 1, 60)
    assert_idle(engine)


class _RejectingMatcher:
    """A matcher that allows every token, then rejects the sampled one (simulates a grammar bug)."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index].fill_(-1)

    def accept_token(self, token: int) -> bool:
        return False

    def is_terminated(self) -> bool:
        return False


class _RejectingGrammar:
    def matcher(self) -> _RejectingMatcher:
        return _RejectingMatcher()


@requires_model
@pytest.mark.slow
def test_a_rejected_token_aborts_instead_of_running_unconstrained(engine):
    before = counter(engine, "grammar_aborts_total")
    req = GenerateRequest(uuid.uuid4().hex, chat_ids(engine, "Hi"), SamplingParams(temperature=0.0, max_new_tokens=8))
    req.grammar = _RejectingGrammar()

    async def go():
        return [out async for out in engine.generate(req)]

    outs = asyncio.run(go())
    assert outs[-1].finish_reason["type"] == "abort" and outs[-1].finish_reason["status_code"] == 500
    assert "grammar" in outs[-1].finish_reason["message"]
    assert sum(len(o.token_ids) for o in outs) == 0  # the rejected token was never emitted
    assert counter(engine, "grammar_aborts_total") == before + 1
    assert_idle(engine)


@requires_model
@pytest.mark.slow
def test_metrics_are_exported(engine, url):
    run(engine, chat_ids(engine, "Pick a primary color."), json_schema=json.dumps(SCHEMA_PROMPTS[10][1]))
    text = httpx.get(url + "/metrics", timeout=30).text
    for name in (
        "grammar_compile_seconds_count",
        "grammar_cache_hits_total",
        "num_grammar_queue_reqs",
        "num_constrained_requests_total",
        "grammar_aborts_total",
    ):
        assert re.search(rf"^radixserve_engine_{name}\{{", text, re.M), name
    m = re.search(r"^radixserve_engine_grammar_compile_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    assert float(m.group(1)) >= 1


# ------------------------------------------------------------------------------------------------- HTTP


def _sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]


@requires_model
@pytest.mark.slow
def test_native_streaming_with_a_schema(url):
    body = {
        "text": "Describe a person as JSON:",
        "sampling_params": {"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 160},
    }
    full = httpx.post(url + "/generate", json=body, timeout=300).json()
    events = _sse(url, body)
    assert len(events) > 2
    text = "".join(e["text"] for e in events)
    assert text == full["text"]
    jsonschema.validate(json.loads(text), PERSON)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}


@requires_model
@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_native_invalid_grammar_is_an_http_400_even_when_streaming(url, stream):
    for _ in range(2):
        r = httpx.post(
            url + "/generate", json={"text": "x", "stream": stream, "sampling_params": {"regex": r"(a+)\1"}}, timeout=60
        )
        assert r.status_code == 400, r.text
        assert "Backreference" in r.json()["error"]["message"] and r.json()["error"]["param"] == "regex"
    r = httpx.post(
        url + "/generate",
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        timeout=300,
    )
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "length"


# ------------------------------------------------------------------------------------------------- retraction


@requires_model
@pytest.mark.slow
def test_retracted_constrained_requests_resume_consistently(engine):
    """A retracted request keeps ``output_ids`` and its matcher (which accepted exactly those tokens), then
    re-prefills them: the greedy outputs equal the ones of an engine with room to spare."""
    from radixserve.engine.engine import Engine

    prompts = [chat_ids(engine, p) for p, _ in SCHEMA_PROMPTS[:4]]
    schemas = [s for _, s in SCHEMA_PROMPTS[:4]]
    # 32 new tokens reserve 9 slots each at admission (36 <= 40: all four start together); together they need more
    # than the 40 spare slots, so the newest are retracted and resumed.
    jobs = [(ids, {"json_schema": json.dumps(s), "max_new_tokens": 32}) for ids, s in zip(prompts, schemas)]
    reference = run_many(engine, jobs)
    assert sum(len(r[0]["ids"]) for r in reference) > 60
    shared = len(__import__("os").path.commonprefix(prompts))
    need = sum(len(p) for p in prompts) - 3 * shared
    small = Engine(dataclasses.replace(engine.args, max_total_tokens=need + 40))
    small.start()
    try:
        outs = run_many(small, jobs)
        assert small.metrics.num_retracted_reqs_total._value.get() >= 1
        assert [o[0]["ids"] for o in outs] == [r[0]["ids"] for r in reference]
        assert_idle(small)
    finally:
        small.shutdown()


def test_bound_json_numbers_rewrites_only_generic_number_rules():
    from radixserve.engine.grammar.xgrammar_backend import MAX_NUMBER_DIGITS, bound_json_numbers

    ebnf = "\n".join(
        [
            'basic_integer ::= (("0") | (basic_integer_1 [1-9] [0-9]*))',
            'basic_number_2 ::= (("0") | ([1-9] [0-9]*))',
            'basic_number_3 ::= ("" | ("." basic_number_digits{1, -1}))',
            'basic_number_5 ::= ("" | ([eE] basic_number_4 basic_number_digits{1, -1}))',
            "root_1 ::= (([1-9] [0-9]*))",
        ]
    )
    lines = bound_json_numbers(ebnf).splitlines()
    assert lines[0].endswith(f"[0-9]{{0,{MAX_NUMBER_DIGITS - 1}}}))")
    assert lines[1].endswith(f"[0-9]{{0,{MAX_NUMBER_DIGITS - 1}}}))")
    assert f"basic_number_digits{{1,{MAX_NUMBER_DIGITS}}}" in lines[2]
    assert "basic_number_digits{1,3}" in lines[3]
    assert lines[4] == "root_1 ::= (([1-9] [0-9]*))"  # a user's pattern stays as written


@requires_model
@pytest.mark.slow
def test_unconstrained_numbers_have_bounded_digits(engine):
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    g = engine.grammar_backend.get_sync("json_schema", json.dumps(schema))
    m = g.matcher()
    assert all(m.accept_string(c) for c in '{"x":1.')
    assert all(m.accept_string("1") for _ in range(15))
    assert not m.accept_string("1")  # a 16th fraction digit
    assert m.accept_string("}")


def test_bound_schema_numbers_closes_one_sided_ranges_only():
    from radixserve.engine.grammar.xgrammar_backend import NUMBER_BOUND, bound_schema_numbers

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0},
            "b": {"type": ["number", "null"], "exclusiveMaximum": 5},
            "c": {"type": "integer", "minimum": 1, "maximum": 3},
            "d": {"type": "integer"},  # unbounded: the EBNF rewrite bounds its digits
            "e": {"type": "integer", "minimum": 10**20},  # above the bound: left alone
            "f": {"enum": [{"type": "integer", "minimum": 0}]},  # data, not a schema
        },
    }
    out = bound_schema_numbers(schema)["properties"]
    assert out["a"] == {"type": "integer", "minimum": 0, "maximum": NUMBER_BOUND}
    assert out["b"]["minimum"] == -NUMBER_BOUND and "maximum" not in out["b"]
    assert out["c"] == schema["properties"]["c"] and out["d"] == schema["properties"]["d"]
    assert out["e"] == schema["properties"]["e"] and out["f"] == schema["properties"]["f"]
    assert schema["properties"]["a"] == {"type": "integer", "minimum": 0}  # the input is not modified


@requires_model
@pytest.mark.slow
def test_invalid_grammar_with_max_tokens_zero_is_still_400(url):
    r = httpx.post(
        url + "/generate",
        json={"text": "x", "sampling_params": {"max_new_tokens": 0, "json_schema": '{"type": "strin"}'}},
        timeout=60,
    )
    assert r.status_code == 400 and "strin" in r.json()["error"]["message"], r.text
    r = httpx.post(
        url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 0, "regex": "a"}}, timeout=60
    )
    assert r.status_code == 200 and r.json()["text"] == ""


# ------------------------------------------------------------------------------------------------- compile queue

# A heavy grammar: each pattern property costs ~0.15 s of compile on one core (the tester's had 302 of them, ~55 s).
HEAVY_PROP = {"type": "string", "pattern": "[a-z]{1,200}@[a-z]{1,100}\\.[a-z]{2,50}"}


def _heavy_schema(n: int, tag: str = "p") -> str:
    return json.dumps(
        {
            "type": "object",
            "properties": {f"{tag}{i}": HEAVY_PROP for i in range(n)},
            "required": [f"{tag}{i}" for i in range(n)],
        }
    )


def _backend(**kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    from radixserve.engine.grammar.xgrammar_backend import GrammarBackend

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    # The limits apply after the warm-up compile, which builds the TokenizerInfo first (regression: under load that
    # took over the 0.3 s queue limit of the busy-workers test, whose warm-up itself was then refused with a 503).
    limits = {k: kwargs.pop(k) for k in ("queue_timeout_s", "compile_timeout_s") if k in kwargs}
    backend = GrammarBackend(tok, V, [2], **kwargs)
    backend.get_sync("regex", "warm")
    for name, value in limits.items():
        setattr(backend, name, value)
    return backend


@requires_model
def test_trivial_grammar_does_not_wait_behind_a_heavy_one_and_the_timeout_blames_only_its_own_compile():
    # Regression: one compile worker; a trivial regex queued behind a heavy schema timed out on the heavy one's time
    # ("took longer than 60 s to compile; simplify it").
    backend = _backend(compile_timeout_s=1.0)
    try:
        heavy = _heavy_schema(40)  # several seconds of compile, far over the 1 s limit

        async def go():
            heavy_task = asyncio.create_task(backend.get("json_schema", heavy))
            await asyncio.sleep(0.2)  # the heavy compile is running
            small = await backend.get("regex", "yes|no|maybe301")
            heavy_running = not heavy_task.done()
            with pytest.raises(InvalidRequestError) as e:
                await heavy_task
            return small, heavy_running, e.value

        small, heavy_running, err = asyncio.run(go())
        assert small.kind == "regex" and heavy_running  # the trivial grammar finished while the heavy one compiled
        assert err.status_code == 400 and err.param == "json_schema"
        assert "too complex" in err.message and "1 s" in err.message and "own compile" in err.message
        # The timeout failure is cached: the same schema is refused at once, without another compile.
        fut = backend.future("json_schema", heavy)
        assert fut.done() and isinstance(fut.exception(), InvalidRequestError)
        with pytest.raises(InvalidRequestError, match="too complex"):
            backend.get_sync("json_schema", heavy)
    finally:
        backend.shutdown()


@requires_model
def test_busy_workers_are_a_503_not_the_grammar_fault_and_abandoned_queued_compiles_are_cancelled():
    backend = _backend(num_workers=1, queue_timeout_s=0.3, compile_timeout_s=120)
    try:

        async def go():
            heavy = asyncio.create_task(backend.get("json_schema", _heavy_schema(15)))
            await asyncio.sleep(0.2)
            with pytest.raises(InvalidRequestError) as e:
                await backend.get("regex", "yes|no")  # queued behind the heavy compile on the only worker
            queued = asyncio.create_task(backend.get("json_schema", _heavy_schema(15, "q")))
            await asyncio.sleep(0.1)
            assert backend.num_pending() == 2  # the heavy compile + the queued one (the 503'd regex was cancelled)
            queued.cancel()  # its only client left before its compile started
            await asyncio.sleep(0.1)
            pending_after_cancel = backend.num_pending()
            heavy.cancel()  # a running compile cannot be interrupted; it still finishes and is cached
            return e.value, pending_after_cancel

        err, pending_after_cancel = asyncio.run(go())
        assert err.status_code == 503 and "retry" in err.message and "busy" in err.message
        assert pending_after_cancel == 1  # only the running heavy compile is left
        assert ("regex", "yes|no") not in backend._cache  # a busy 503 is not cached as a failure
        assert ("json_schema", _heavy_schema(15, "q")) not in backend._cache
        g = backend.get_sync("json_schema", _heavy_schema(15))  # the abandoned running compile finished and is cached
        assert g.kind == "json_schema" and backend.num_pending() == 0
    finally:
        backend.shutdown()


# ------------------------------------------------------------------------------------------------- unsupported schema

STR = {"type": "string"}
UNSUPPORTED_SCHEMAS = [
    ({"not": STR}, "not", "#/not"),
    (
        {"type": "object", "properties": {"tags": {"type": "array", "items": STR, "uniqueItems": True}}},
        "uniqueItems",
        "#/properties/tags/uniqueItems",
    ),
    ({"type": "array", "contains": STR}, "contains", "#/contains"),
    ({"if": STR, "then": {"maxLength": 1}, "else": {"type": "integer"}}, "if", "#/if"),
    (
        {"type": "object", "properties": {"a": {"allOf": [{"type": "integer"}, {"minimum": 5}]}}},
        "allOf",
        "#/properties/a/allOf",
    ),
    ({"type": "object", "minProperties": 2}, "minProperties", "#/minProperties"),
    ({"type": "object", "maxProperties": 1}, "maxProperties", "#/maxProperties"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames", "#/propertyNames"),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, "patternProperties", "#/patternProperties"),
    (
        {"type": "object", "properties": {"a": STR, "b": STR}, "dependentRequired": {"a": ["b"]}},
        "dependentRequired",
        "#/dependentRequired",
    ),
    (
        {"type": "object", "properties": {"a": STR}, "dependentSchemas": {"a": {"required": ["b"]}}},
        "dependentSchemas",
        "#/dependentSchemas",
    ),
    (
        {"type": "object", "properties": {"a": STR}, "unevaluatedProperties": False},
        "unevaluatedProperties",
        "#/unevaluatedProperties",
    ),
    ({"type": "array", "prefixItems": [STR], "unevaluatedItems": False}, "unevaluatedItems", "#/unevaluatedItems"),
    (
        {"type": "object", "properties": {"a": STR}, "required": ["b"], "additionalProperties": False},
        "required",
        "#/required",
    ),
    # nested in $defs, items, anyOf, oneOf, definitions
    ({"$defs": {"x": {"not": STR}}, "$ref": "#/$defs/x"}, "not", "#/$defs/x/not"),
    ({"type": "array", "items": {"type": "object", "minProperties": 1}}, "minProperties", "#/items/minProperties"),
    ({"anyOf": [STR, {"type": "array", "uniqueItems": True}]}, "uniqueItems", "#/anyOf/1/uniqueItems"),
    ({"oneOf": [{"type": "array", "contains": STR}]}, "contains", "#/oneOf/0/contains"),
    ({"definitions": {"a/b": {"if": STR}}, "$ref": "#/definitions/a~1b"}, "if", "#/definitions/a~1b/if"),
]


@pytest.mark.parametrize("schema,keyword,pointer", UNSUPPORTED_SCHEMAS)
def test_unsupported_schema_keywords_are_refused_with_their_path(schema, keyword, pointer):
    from radixserve.engine.grammar.xgrammar_backend import check_schema_supported

    with pytest.raises(InvalidRequestError) as e:
        check_schema_supported(schema)
    assert e.value.status_code == 400 and e.value.param == "json_schema"
    assert repr(keyword) in e.value.message and f"at {pointer}:" in e.value.message, e.value.message


SUPPORTED_SCHEMAS = [
    (
        "Describe a person with a nested address.",
        _obj({"name": S, "address": _obj({"city": S, "zip": {"type": "string", "pattern": "[0-9]{5}"}})}),
    ),
    (
        "List two colors.",
        _obj(
            {
                "colors": {
                    "type": "array",
                    "items": {"enum": ["red", "green", "blue"]},
                    "minItems": 2,
                    "maxItems": 2,
                    "uniqueItems": False,
                }
            }
        ),
    ),
    (
        "Give a point.",
        {
            "$defs": {"n": {"type": "integer", "minimum": -5, "maximum": 5}},
            **_obj({"x": {"$ref": "#/$defs/n"}, "y": {"$ref": "#/$defs/n"}}),
        },
    ),
    (
        "Give an id or nothing.",
        _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}}),
    ),
    (
        "A value.",
        _obj(
            {
                "v": {"oneOf": [{"const": "none"}, {"type": "boolean"}]},
                "w": {"type": ["integer", "null"], "maximum": 9, "minimum": 0},
            }
        ),
    ),
    (
        "When and where?",
        _obj(
            {
                "day": {"type": "string", "format": "date"},
                "ip": {"type": "string", "format": "ipv4"},
                "id": {"type": "string", "format": "uuid"},
                "at": {"type": "string", "format": "date-time"},
            }
        ),
    ),
    (
        "A ratio.",
        _obj(
            {
                "r": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                "k": {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 30},
                "s": {"type": "string", "minLength": 2, "maxLength": 8},
            }
        ),
    ),
    ("A name.", {"allOf": [_obj({"name": S})]}),
    (
        "A titled thing.",
        {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "urn:x",
            "title": "T",
            "description": "d",
            "examples": [{"a": 1}],
            "default": {"a": 1},
            **_obj({"a": {"type": "integer", "minimum": 0, "maximum": 9, "title": "A"}}),
        },
    ),
]


@requires_model
@pytest.mark.slow
def test_supported_schema_features_still_generate_valid_output(engine):
    from radixserve.engine.grammar.xgrammar_backend import check_schema_supported

    for _, schema in SUPPORTED_SCHEMAS:
        check_schema_supported(schema)
    jobs = [(chat_ids(engine, p), {"json_schema": json.dumps(s), "max_new_tokens": 200}) for p, s in SUPPORTED_SCHEMAS]
    outs = run_many(engine, jobs)
    for (_, schema), out in zip(SUPPORTED_SCHEMAS, outs):
        assert_valid_json(out[0]["text"], schema, out[0]["finish"])
    assert_idle(engine)


@requires_model
@pytest.mark.slow
def test_unsupported_schema_is_an_http_400_naming_keyword_and_path(url):
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": STR, "uniqueItems": True}},
        "required": ["tags"],
    }
    for _ in range(2):  # the second from the failure cache
        r = httpx.post(
            url + "/generate", json={"text": "x", "sampling_params": {"json_schema": json.dumps(schema)}}, timeout=60
        )
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "'uniqueItems'" in message and "#/properties/tags" in message


@requires_model
def test_a_grammar_that_matches_no_string_is_a_400_at_compile():
    # Regression (new-user try): the regex [^\s\S] compiled, then its first decode step failed with "the grammar
    # rejected token 0": a 500 on the OpenAI endpoints, a 200 aborted with status 500 on /generate. The empty regex
    # (only the empty string: eos allowed) still compiles. Only a dead start is found here: "a[^\s\S]" is refused
    # after its "a", at run time (test_a_grammar_that_dies_after_its_start_is_a_400_not_a_500).
    backend = _backend()
    try:
        for text in [r"[^\s\S]", r"([^\s\S])+|[^\s\S]x"]:
            with pytest.raises(InvalidRequestError, match="invalid regex: it matches no string") as e:
                backend.get_sync("regex", text)
            assert e.value.status_code == 400 and e.value.param == "regex"
        assert backend.get_sync("regex", "").kind == "regex"
    finally:
        backend.shutdown()


@requires_model
@pytest.mark.slow
def test_a_grammar_that_dies_after_its_start_is_a_400_not_a_500(engine, url):
    # Regression (new-user try): the regex a[^\s\S] compiles and allows "a" first, then no token at all: the sampler
    # picked a masked-out token and the request ended "the grammar rejected token 0", a 500. Now it is the client's
    # constraint: an abort with status 400, the engine idle and serving afterwards.
    before = counter(engine, "grammar_aborts_total")
    out = run(engine, chat_ids(engine, "Say a."), regex=r"a[^\s\S]", max_new_tokens=8)[0]
    finish = out["finish"]
    assert finish["type"] == "abort" and finish["status_code"] == 400, out
    assert "no string it matches starts with the 1 token(s) generated so far" in finish["message"]
    assert counter(engine, "grammar_aborts_total") == before + 1
    body = {"model": engine.served_model_name, "prompt": "Say a.", "max_tokens": 8, "regex": r"a[^\s\S]"}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400 and "invalid constraint" in r.json()["error"]["message"]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][len("data: ") :])["error"]["code"] == 400
    assert_idle(engine)
    ok = httpx.post(url + "/v1/completions", json={**body, "regex": "ab?"}, timeout=60)
    assert ok.status_code == 200 and re.fullmatch("ab?", ok.json()["choices"][0]["text"]), ok.text
