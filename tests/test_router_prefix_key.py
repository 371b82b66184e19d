"""Router prefix keys: the blocks are what the engine caches (same rendering and token ids), chained and namespaced."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.router.prefix_key import PrefixKeyExtractor
from radixserve.router.tokenizer import tokenizer_from_files

from conftest import MODEL_DIR, requires_model

MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a meticulous assistant for a travel agency. Answer in at most three sentences, cite prices in euros."
TURNS = [
    (
        "Which trains go from Paris to Lyon on a Sunday morning, and how long does the trip take?",
        "TGV trains leave Paris Gare de Lyon roughly every hour from six in the morning; the trip takes two hours.",
    ),
    (
        "And how much would a second class ticket cost if I book three weeks in advance?",
        "Booked three weeks ahead, a second class ticket usually costs between 25 and 60 euros.",
    ),
    (
        "Can I bring a bicycle on board, or does it have to travel separately in a bag?",
        "Folded or bagged bicycles travel free as luggage; some TGVs also sell bicycle spaces for 10 euros.",
    ),
]


def conversation(turns: int, system: str | None = SYSTEM) -> list[dict]:
    """Messages of a conversation up to the user message of turn ``turns`` (1-based)."""
    msgs = [{"role": "system", "content": system}] if system else []
    for i in range(turns):
        msgs.append({"role": "user", "content": TURNS[i][0]})
        if i < turns - 1:
            msgs.append({"role": "assistant", "content": TURNS[i][1]})
    return msgs


@pytest.fixture(scope="module")
def tok():
    if not os.path.exists(os.path.join(MODEL_DIR, "config.json")):
        pytest.skip("demo model not converted; run `make install`")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture()
def ex(tok):
    e = PrefixKeyExtractor(block_tokens=16, prefix_blocks=4)
    e.set_tokenizer(MODEL, tok)
    return e


# ---------------------------------------------------------------------------------------------------- tokenizer files


@requires_model
def test_tokenizer_from_served_files_keys_like_the_original(tok):
    """The engine's /get_tokenizer_files payload rebuilds a tokenizer whose keys equal the original's."""
    from radixserve.engine.server.http import saved_tokenizer_files

    files = saved_tokenizer_files(tok)
    assert "tokenizer.json" in files
    rebuilt = tokenizer_from_files(files)
    a, b = PrefixKeyExtractor(), PrefixKeyExtractor()
    a.set_tokenizer(MODEL, tok)
    b.set_tokenizer(MODEL, rebuilt)
    assert b.has_tokenizer(MODEL) and not b.has_tokenizer("other")
    body = {"messages": conversation(3)}
    ka, kb = a.extract("chat", body, MODEL), b.extract("chat", body, MODEL)
    assert ka is not None and ka.kind == "tokens" and len(ka.blocks) > 0
    assert ka == kb
    text = "Hello there! Ünïcödé café, 日本語 🙂 " * 20
    assert a.extract("completions", {"prompt": text}, MODEL) == b.extract("completions", {"prompt": text}, MODEL)


@requires_model
def test_router_tokenizer_does_not_import_torch(tok):
    """Regression: the router built its tokenizer with AutoTokenizer, which imports torch (~250 MiB of RSS in a
    process that runs no model). The rebuilt tokenizer, in a fresh interpreter, leaves torch unimported."""
    import json
    import subprocess
    import sys

    from radixserve.engine.server.http import saved_tokenizer_files

    script = (
        "import json, sys\n"
        "from radixserve.router.tokenizer import tokenizer_from_files\n"
        "t = tokenizer_from_files(json.load(sys.stdin))\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'ids': t.encode('hello world')}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(saved_tokenizer_files(tok)),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result == {"torch": False, "ids": tok.encode("hello world")}


@pytest.mark.parametrize("name", ["../tokenizer.json", "a/b.json", "a\\b.json", "..", "", "x..json"])
def test_tokenizer_files_reject_path_names(name):
    with pytest.raises(ValueError):
        tokenizer_from_files({"tokenizer.json": "{}", name: "{}"})


def test_tokenizer_files_reject_empty_and_binary():
    with pytest.raises(ValueError):
        tokenizer_from_files({})
    with pytest.raises(ValueError):
        tokenizer_from_files({"tokenizer.json": b"\x00\x01"})  # type: ignore[dict-item]


# ---------------------------------------------------------------------------------------------------- token keys


def test_chat_key_is_the_engines_prompt(ex, tok):
    """Chat blocks are the blocks of the engine's own rendering (render_prompt + encode without special tokens),
    including developer -> system, content parts joined by newlines, and names."""
    from radixserve.contracts.protocol import ChatCompletionRequest
    from radixserve.engine.server.chat import render_prompt

    messages = [
        {"role": "developer", "content": SYSTEM},
        {
            "role": "user",
            "name": "ana",
            "content": [{"type": "text", "text": TURNS[0][0]}, {"type": "text", "text": "Thanks!"}],
        },
        {"role": "assistant", "content": TURNS[0][1]},
        {"role": "user", "content": TURNS[1][0]},
    ]
    engine_prompt = render_prompt(tok, ChatCompletionRequest(model=MODEL, messages=messages))
    engine_ids = tok.encode(engine_prompt, add_special_tokens=False)
    key = ex.extract("chat", {"model": MODEL, "messages": messages}, MODEL)
    by_ids = ex.extract("completions", {"prompt": engine_ids}, MODEL)
    assert key is not None and key == by_ids
    assert key.prompt_tokens == len(engine_ids)
    assert len(key.blocks) == len(engine_ids) // 16


@pytest.mark.parametrize("system", [SYSTEM, None], ids=["system-prompt", "no-system-prompt"])
def test_chat_turns_share_leading_blocks(ex, system):
    """Turn n's prompt is a prefix of turn n+1's, so all of turn n's full blocks reappear in turn n+1's key."""
    keys = [ex.extract("chat", {"messages": conversation(n, system)}, MODEL) for n in (1, 2, 3)]
    for a, b in zip(keys, keys[1:]):
        assert len(b.blocks) > len(a.blocks) > 0
        assert b.blocks[: len(a.blocks)] == a.blocks
        assert b.prompt_tokens > a.prompt_tokens
    long_enough = [k for k in keys if len(k.blocks) >= ex.prefix_blocks]
    assert long_enough, "the conversation should reach K blocks"
    assert all(k.routing_key == k.blocks[ex.prefix_blocks - 1] for k in long_enough)
    assert len({k.routing_key for k in long_enough}) == 1


def test_completions_and_generate_text_share_keys(ex, tok):
    text = SYSTEM + " " + TURNS[0][0] + " " + TURNS[1][0]
    ids = tok.encode(text)
    keys = [
        ex.extract("completions", {"prompt": text}, MODEL),
        ex.extract("completions", {"prompt": [text, "second prompt of the batch"]}, MODEL),
        ex.extract("completions", {"prompt": ids}, MODEL),
        ex.extract("completions", {"prompt": [ids, [1, 2, 3]]}, MODEL),
        ex.extract("generate", {"text": text}, MODEL),
        ex.extract("generate", {"text": [text]}, MODEL),
        ex.extract("generate", {"input_ids": ids}, MODEL),
        ex.extract("generate", {"input_ids": [ids, [4, 5]]}, MODEL),
    ]
    assert keys[0] is not None and len(keys[0].blocks) == len(ids) // 16
    assert all(k == keys[0] for k in keys)


def test_models_and_salts_never_share_hashes(tok):
    ex = PrefixKeyExtractor()
    ex.set_tokenizer("a", tok)
    ex.set_tokenizer("b", tok)
    body = {"messages": conversation(3)}
    ka, kb = ex.extract("chat", body, "a"), ex.extract("chat", body, "b")
    assert ka.prompt_tokens == kb.prompt_tokens and len(ka.blocks) > 0
    assert not set(ka.blocks) & set(kb.blocks) and ka.routing_key != kb.routing_key
    salted = ex.extract("chat", {**body, "cache_salt": "tenant-1"}, "a")
    assert salted.prompt_tokens == ka.prompt_tokens and not set(salted.blocks) & set(ka.blocks)
    assert ex.extract("chat", {**body, "cache_salt": "tenant-1"}, "a") == salted
    assert not set(ex.extract("chat", {**body, "cache_salt": "tenant-2"}, "a").blocks) & set(salted.blocks)
    # prompts shorter than one block: no blocks, a routing key of their own, still per model
    short_a = ex.extract("completions", {"prompt": "Hi"}, "a")
    assert short_a.blocks == () and short_a.routing_key == ex.extract("completions", {"prompt": "Hi"}, "a").routing_key
    assert short_a.routing_key != ex.extract("completions", {"prompt": "Hi"}, "b").routing_key


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 49151), min_size=16, max_size=200),
    where=st.integers(0, 10_000),
    delta=st.integers(1, 1000),
)
def test_changing_one_token_changes_exactly_the_blocks_from_its_block_on(ids, where, delta):
    """Chaining: block i's hash depends on every token of blocks 0..i and on nothing after."""
    ex = PrefixKeyExtractor(block_tokens=16, max_blocks=10)
    pos = where % len(ids)
    changed = list(ids)
    changed[pos] = (changed[pos] + delta) % 49152
    a = ex.extract("completions", {"prompt": ids}, "m")
    b = ex.extract("completions", {"prompt": changed}, "m")
    assert a.kind == "tokens" and len(a.blocks) == min(len(ids) // 16, 10) == len(b.blocks)
    j = pos // 16
    assert a.blocks[:j] == b.blocks[:j]
    assert all(x != y for x, y in zip(a.blocks[j:], b.blocks[j:]))
    if len(a.blocks) >= ex.prefix_blocks or len(ids) == 16 * len(a.blocks):
        assert a.routing_key == a.blocks[min(ex.prefix_blocks, len(a.blocks)) - 1]
    else:  # shorter than K blocks, a partial one last: the key covers the whole prompt
        assert a.routing_key != b.routing_key


# ---------------------------------------------------------------------------------------------------- character keys


def test_character_keys_without_tokenizer():
    ex = PrefixKeyExtractor(block_chars=64, prefix_blocks=2)
    assert not ex.has_tokenizer(MODEL)
    keys = [ex.extract("chat", {"messages": conversation(n)}, MODEL) for n in (1, 2, 3)]
    for a, b in zip(keys, keys[1:]):
        assert a.kind == "chars" and a.block_tokens == 16
        assert len(b.blocks) > len(a.blocks) > 0 and b.blocks[: len(a.blocks)] == a.blocks
    text = SYSTEM * 3
    k = ex.extract("completions", {"prompt": text}, MODEL)
    assert len(k.blocks) == len(text) // 64 and k.prompt_tokens == -(-len(text) // 4)
    assert k == ex.extract("generate", {"text": text}, MODEL)
    assert k.routing_key == k.blocks[1]
    # token ids are exact even without a tokenizer
    assert ex.extract("generate", {"input_ids": list(range(40))}, MODEL).kind == "tokens"
    # chars and tokens never share hashes, nor do models
    assert not set(k.blocks) & set(ex.extract("completions", {"prompt": text}, "other").blocks)


def test_max_blocks_caps_the_key():
    ex = PrefixKeyExtractor(block_chars=8, max_blocks=5)
    k = ex.extract("completions", {"prompt": "x" * 1000}, "m")
    assert len(k.blocks) == 5 and k.prompt_tokens == 250


# ---------------------------------------------------------------------------------------------------- malformed bodies

MALFORMED = [
    ("chat", {}),
    ("chat", {"messages": []}),
    ("chat", {"messages": "hello"}),
    ("chat", {"messages": [{"content": "no role"}]}),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    ("chat", {"messages": [{"role": "user", "content": 42}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": 3}]}),
    ("chat", {"messages": [{"role": "user", "content": "lone \ud800 surrogate"}]}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "cache_salt": {1, 2}}),
    ("completions", {}),
    ("completions", {"prompt": []}),
    ("completions", {"prompt": [[]]}),
    ("completions", {"prompt": [-1, 5]}),
    ("completions", {"prompt": [1, "a"]}),
    ("completions", {"prompt": [2**40]}),
    ("completions", {"prompt": [{"a": 1}]}),
    ("completions", {"prompt": 12}),
    ("generate", {}),
    ("generate", {"text": "a", "input_ids": [1]}),
    ("generate", {"text": []}),
    ("generate", {"input_ids": ["a"]}),
    ("generate", {"input_ids": [["a"]]}),
    ("embeddings", {"input": "hi"}),
]


@pytest.mark.parametrize("with_tokenizer", [False, True], ids=["chars", "tokens"])
@pytest.mark.parametrize("endpoint,body", MALFORMED)
def test_malformed_bodies_give_no_key(request, endpoint, body, with_tokenizer):
    ex = PrefixKeyExtractor()
    if with_tokenizer:
        ex.set_tokenizer(MODEL, request.getfixturevalue("tok"))
    assert ex.extract(endpoint, body, MODEL) is None
    assert ex.extract(endpoint, "not a dict", MODEL) is None  # type: ignore[arg-type]


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=80),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
_bodies = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant", "developer", "bogus"]) | _json},
                optional={"content": _json, "name": _json},
            ),
            max_size=3,
        )
        | _json,
        "prompt": _json,
        "text": _json,
        "input_ids": _json,
        "cache_salt": _json,
    },
)


@requires_model
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endpoint=st.sampled_from(["chat", "completions", "generate"]), body=_bodies, use_tok=st.booleans())
def test_extract_never_raises(tok, endpoint, body, use_tok):
    ex = PrefixKeyExtractor(block_tokens=4, block_chars=8)
    if use_tok:
        ex.set_tokenizer(MODEL, tok)
    key = ex.extract(endpoint, body, MODEL)
    if key is not None:
        assert key.model == MODEL and key.prompt_tokens >= 0
        if key.kind == "tokens":
            assert len(key.blocks) == key.prompt_tokens // 4


@requires_model
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_huge_prompt_renders_and_tokenizes_only_what_blocks_can_reach(tok, endpoint):
    """Regression: 7.5 MB prompts were rendered and tokenized in full (39 s and 2 GB per request in the router).
    Only the first ``max_chars`` characters are tokenized; the blocks equal those of the full prompt and the rest of
    the prompt is estimated at 4 characters per token."""
    words = " ".join(f"w{i % 977}" for i in range(40_000))  # ~240k characters, ~3.5 chars per token
    body = (
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": words},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": words},
            ]
        }
        if endpoint == "chat"
        else {"prompt": words * 2}
    )
    small = PrefixKeyExtractor(block_tokens=16, prefix_blocks=4, max_blocks=64)
    small.set_tokenizer(MODEL, tok)
    unbounded = PrefixKeyExtractor(block_tokens=16, prefix_blocks=4, max_blocks=64)
    unbounded.set_tokenizer(MODEL, tok)
    unbounded.max_chars = 10**9
    cut, full = small.extract(endpoint, body, MODEL), unbounded.extract(endpoint, body, MODEL)
    assert small.max_chars == 64 * 16 * 8 < len(words)
    assert cut.blocks == full.blocks and len(cut.blocks) == 64 and cut.routing_key == full.routing_key
    assert 0.6 * full.prompt_tokens < cut.prompt_tokens < 1.4 * full.prompt_tokens  # estimated past the cut
