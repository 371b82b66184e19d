"""The radix cache's block events (engine/memory/cache_events.py) and the engine's cache-state routes
(engine/server/cache_state.py): the published blocks are exactly the full blocks of the tree, in the router's hash
scheme (contracts/block_hash.py), so router and engine agree by construction. No model: the radix cache over a small
allocator, the scheduler over a stand-in runner, the HTTP layer over tests/fake_engine.py."""

from __future__ import annotations

import json
from hashlib import blake2b
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.contracts import block_hash as bh
from radixserve.engine.config import EngineArgs
from radixserve.engine.engine import Engine
from radixserve.engine.io_struct import GenerateRequest, SamplingParams
from radixserve.engine.memory.allocator import TokenSlotAllocator
from radixserve.engine.memory.cache_events import AllCleared, BlockRemoved, BlockStored, CacheEventLog
from radixserve.engine.memory.radix_cache import RadixCache
from radixserve.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from radixserve.engine.server.http import create_app
from radixserve.router.prefix_key import PrefixKeyExtractor
from test_scheduler_loop import EOS, PROMPTS, CharTokenizer, KVCheckingRunner, run

from conftest import MODEL_DIR, requires_model
from fake_engine import FakeEngine, client, engine, tokenizer  # noqa: F401 - shared pytest fixtures

MODEL = "m"


def make(size: int = 256, block_tokens: int = 4, capacity: int = 100_000) -> tuple[TokenSlotAllocator, RadixCache]:
    alloc = TokenSlotAllocator(size, check=True)
    return alloc, RadixCache(alloc, events=CacheEventLog(MODEL, block_tokens, capacity=capacity))


def put(alloc: TokenSlotAllocator, cache: RadixCache, tokens: list[int]) -> None:
    """Insert ``tokens`` with fresh slots (evicting first when the pool is short), freeing the duplicates."""
    if alloc.available() < len(tokens):
        cache.evict(len(tokens) - alloc.available())
    slots = alloc.alloc(len(tokens))
    assert slots is not None
    k = cache.insert(tokens, slots)
    alloc.free(slots[:k])


def h0(model: str = MODEL) -> bytes:
    d = bh.namespace_digest("tokens", model, None)
    assert d is not None
    return d


def tree_blocks(cache: RadixCache, block_tokens: int) -> set[int]:
    """Every full block of every root-to-node path, hashed independently of the tree's own bookkeeping; checks each
    node's ``depth`` and ``blocks`` (the blocks ending inside its edge) on the way."""
    out: set[int] = set()
    stack: list[tuple[Any, list[int]]] = [(cache.root, [])]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            p = path + child.key
            hashes = bh.chain_block_hashes(h0(), p, block_tokens)
            assert child.depth == len(p)
            assert child.blocks == hashes[len(path) // block_tokens :], "a node's blocks are those ending in its edge"
            out.update(hashes)
            stack.append((child, p))
    return out


def replay(events: Any, live: set[int] | None = None) -> set[int]:
    live = set() if live is None else live
    for ev in events:
        if isinstance(ev, BlockStored):
            assert not live & set(ev.hashes), "a block is stored twice without a removal between"
            live.update(ev.hashes)
        elif isinstance(ev, BlockRemoved):
            assert set(ev.hashes) <= live, "a block is removed that was not stored"
            live.difference_update(ev.hashes)
        else:
            assert isinstance(ev, AllCleared)
            live.clear()
    return live


# ---------------------------------------------------------------------------------------------- the hash scheme


def old_prefix_key_blocks(ids: list[int], model: str, salt: Any, bt: int) -> list[int]:
    """router/prefix_key.py's hashing before it moved to contracts/block_hash.py, inlined: keys must stay
    bit-identical."""
    ns = json.dumps(["tokens", model, salt], ensure_ascii=True, separators=(",", ":"), sort_keys=True)
    prev = blake2b(ns.encode("ascii"), digest_size=8).digest()
    buf = b"".join(t.to_bytes(4, "little") for t in ids)
    out = []
    for off in range(0, len(ids) // bt * bt * 4, 4 * bt):
        prev = blake2b(prev + buf[off : off + 4 * bt], digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=80), bt=st.sampled_from([1, 3, 16]), salt=st.none() | st.text())
def test_block_hashes_are_the_router_keys_bit_for_bit(ids, bt, salt):
    d = bh.namespace_digest("tokens", "model-x", salt)
    assert d is not None
    expected = old_prefix_key_blocks(ids, "model-x", salt, bt)
    assert bh.chain_block_hashes(d, ids, bt) == expected
    key = PrefixKeyExtractor(block_tokens=bt, max_blocks=10_000).extract(
        "generate", {"input_ids": ids, "cache_salt": salt}, "model-x"
    )
    if ids:
        assert key is not None and list(key.blocks) == expected
    # the incremental form chains the same way
    prev, inc = d, []
    for i in range(len(ids) // bt):
        prev = bh.extend_chain(prev, ids[i * bt : (i + 1) * bt])
        inc.append(bh.as_int(prev))
    assert inc == expected
    assert all(bh.as_int(bh.as_digest(x)) == x and 0 <= x < 2**64 for x in expected)


def test_hash_helpers_refuse_what_is_not_token_ids():
    with pytest.raises(OverflowError):
        bh.pack_token_ids([-1])
    with pytest.raises(OverflowError):
        bh.pack_token_ids([2**32])
    with pytest.raises(TypeError):
        bh.pack_token_ids(["a"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        bh.chain_block_hashes(h0(), [1, 2], 0)
    assert bh.namespace_digest("tokens", "m", object()) is None
    assert bh.namespace_digest("tokens", "m", None) != bh.namespace_digest("tokens", "m", "salt")


# ---------------------------------------------------------------------------------------------- the radix cache


def test_insert_publishes_new_full_blocks_only_and_straddling_blocks_belong_where_they_end():
    alloc, cache = make(block_tokens=4)
    log = cache.events
    assert log is not None
    put(alloc, cache, list(range(10)))  # blocks [0,4) [4,8); 8, 9 are a partial block
    a = bh.chain_block_hashes(h0(), list(range(10)), 4)
    assert [type(e) for e in log.since(0).events] == [BlockStored] and log.since(0).events[0].hashes == tuple(a)
    put(alloc, cache, list(range(10)))  # nothing new: no event
    assert log.seq == 1
    put(alloc, cache, [*range(6), 99, 98, 97, 96])  # branches at 6: the block [4,8) of this path ends in the new node
    b = bh.chain_block_hashes(h0(), [*range(6), 99, 98, 97, 96], 4)
    assert log.since(1).events[0].hashes == (b[1],)  # its first block is shared; no partial block
    assert tree_blocks(cache, 4) == set(a) | set(b) == set(log.snapshot().blocks)
    put(alloc, cache, list(range(12)))  # extends the first path: the block [8,12) straddles the old leaf's end
    c = bh.chain_block_hashes(h0(), list(range(12)), 4)
    assert log.since(2).events[0].hashes == (c[2],)
    assert tree_blocks(cache, 4) == set(log.snapshot().blocks)


def test_evict_and_reset_publish_removals_and_clear():
    alloc, cache = make(size=64, block_tokens=2)
    log = cache.events
    assert log is not None
    put(alloc, cache, [1, 2, 3, 4, 5])
    put(alloc, cache, [1, 2, 3, 9, 9, 9])
    cache.match_prefix([1, 2, 3, 9])  # touch the second branch: the first is the LRU leaf
    seq = log.seq
    cache.evict(1)
    (ev,) = log.since(seq).events
    assert isinstance(ev, BlockRemoved)
    assert set(ev.hashes) == set(bh.chain_block_hashes(h0(), [1, 2, 3, 4, 5], 2)[1:])  # [3,4]: ends in the leaf
    assert tree_blocks(cache, 2) == set(log.snapshot().blocks)
    cache.reset()
    assert isinstance(log.since(log.seq - 1).events[0], AllCleared)
    assert log.snapshot().blocks == () and log.live_count() == 0
    put(alloc, cache, [1, 2, 3, 4])  # hashes chain from h_0 again after a reset
    assert set(log.snapshot().blocks) == set(bh.chain_block_hashes(h0(), [1, 2, 3, 4], 2))


# Prompts that share prefixes of every length (so nodes split at every offset within a block), or random ones.
BASES = [[0] * 30, [0, 1] * 15, [i % 5 for i in range(30)]]
TOKENS = st.one_of(
    st.builds(
        lambda base, n, tail: base[:n] + tail,
        st.sampled_from(BASES),
        st.integers(0, 30),
        st.lists(st.integers(0, 3), max_size=4),
    ),
    st.lists(st.integers(0, 3), max_size=30),
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), TOKENS),
        st.tuples(st.just("match"), TOKENS),
        st.tuples(st.just("evict"), st.integers(1, 40)),
        st.tuples(st.just("reset"), st.just(0)),
        st.tuples(st.just("lock"), TOKENS),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, bt=st.sampled_from([1, 3, 4]))
def test_live_blocks_are_the_trees_full_blocks_after_any_operations(ops, bt):
    alloc, cache = make(size=120, block_tokens=bt)
    log = cache.events
    assert log is not None
    locked = []
    for op, arg in ops:
        if op == "insert" and arg:
            put(alloc, cache, arg)
        elif op == "match":
            cache.match_prefix(arg)  # may split a node: no event, the blocks move to the upper node
        elif op == "evict":
            cache.evict(arg)
        elif op == "reset":
            for node in locked:
                cache.dec_lock_ref(node)
            locked.clear()
            cache.reset()
        elif op == "lock" and len(locked) < 3:
            node = cache.match_prefix(arg).last_node
            cache.inc_lock_ref(node)
            locked.append(node)
        expected = tree_blocks(cache, bt)
        snap = log.snapshot()
        assert set(snap.blocks) == expected and list(snap.blocks) == sorted(expected)
    got = log.since(0)
    assert not got.gap and got.seq == log.seq
    assert replay(got.events) == set(log.snapshot().blocks)
    assert [e.seq for e in got.events] == list(range(1, log.seq + 1))


# ---------------------------------------------------------------------------------------------- the log itself


def test_since_reports_a_gap_after_ring_overflow_and_for_a_future_seq():
    log = CacheEventLog(MODEL, 4, capacity=3, incarnation="abc")
    assert log.since(0).gap is False and log.since(0).events == () and log.since(0).seq == 0
    log.stored([1])
    log.stored([])  # nothing: no event
    log.removed([])
    log.stored([2, 3])
    log.removed([1])
    assert [e.seq for e in log.since(0).events] == [1, 2, 3]
    log.cleared()  # seq 4: seq 1 leaves the ring
    gap = log.since(0)
    assert gap.gap and gap.events == () and gap.seq == 4 and gap.incarnation == "abc"
    assert [e.seq for e in log.since(1).events] == [2, 3, 4]  # seq 1 itself is not needed
    assert log.since(4).events == () and not log.since(4).gap
    assert log.since(5).gap and log.since(-1).gap
    assert log.snapshot().blocks == () and log.snapshot().seq == 4
    assert len(CacheEventLog(MODEL, 4).incarnation) == 16
    with pytest.raises(ValueError):
        CacheEventLog(MODEL, 0)
    with pytest.raises(ValueError):
        CacheEventLog(MODEL, 4, capacity=0)


def test_snapshot_then_events_follow_the_cache_exactly():
    alloc, cache = make(size=40, block_tokens=2)
    log = cache.events
    assert log is not None
    put(alloc, cache, [1, 2, 3, 4])
    snap = log.snapshot()
    live = set(snap.blocks)
    put(alloc, cache, [1, 2, 7, 7, 7, 7])
    cache.evict(100)
    put(alloc, cache, [5, 5, 5])
    assert replay(log.since(snap.seq).events, live) == set(log.snapshot().blocks) == tree_blocks(cache, 2)


# ---------------------------------------------------------------------------------------------- the scheduler


def test_the_scheduler_publishes_what_its_radix_cache_holds_and_its_load():
    log = CacheEventLog(MODEL, 4)
    outputs: list[Any] = []
    sched = Scheduler(
        KVCheckingRunner(4096),
        CharTokenizer(),
        SchedulerConfig(context_length=512, chunked_prefill_size=16),
        [EOS],
        outputs.extend,
        cache_events=log,
    )
    assert sched.load.max_total_tokens == 4096 and sched.load.queued_requests == 0
    run(sched, outputs, PROMPTS, max_new_tokens=5)
    assert isinstance(sched.cache, RadixCache)
    assert set(log.snapshot().blocks) == tree_blocks(sched.cache, 4) != set()
    # every prompt's full blocks are held, hashed as the router keys them
    key = PrefixKeyExtractor(block_tokens=4).extract("generate", {"input_ids": PROMPTS[0]}, MODEL)
    assert key is not None and set(key.blocks) <= set(log.snapshot().blocks)
    assert sched.load.running_requests == 0 and sched.load.running_tokens == 0
    # load: a queued request counts its whole prompt (its cached prefix is matched only at admission)
    sched.submit(GenerateRequest("q", list(range(3, 40)), SamplingParams(max_new_tokens=3, ignore_eos=True)))
    sched._recv(block=False)
    sched._update_gauges()
    assert sched.load.queued_requests == 1 and sched.load.queued_prefill_tokens == 37
    with torch.inference_mode():
        sched.step()  # prefill (16 of 37 tokens: chunked)
    assert sched.load.queued_requests == 0 and sched.load.running_requests == 1
    assert sched.load.queued_prefill_tokens == 21 and sched.load.running_tokens >= 16
    with torch.inference_mode():
        while not any(o.finished and o.rid == "q" for o in outputs):
            sched.step()
    assert sched.flush_cache()
    assert log.snapshot().blocks == () and isinstance(log.since(log.seq - 1).events[0], AllCleared)


def test_no_events_without_a_log_or_with_the_radix_cache_off():
    sched = Scheduler(
        KVCheckingRunner(256),
        CharTokenizer(),
        SchedulerConfig(disable_radix_cache=True, context_length=128),
        [EOS],
        lambda outs: None,
        cache_events=CacheEventLog(MODEL, 4),
    )
    assert not hasattr(sched.cache, "events")  # NoPrefixCache publishes nothing
    alloc = TokenSlotAllocator(32, check=True)
    cache = RadixCache(alloc)
    put(alloc, cache, list(range(20)))
    assert cache.events is None and cache.root.children[0].blocks == []


# ---------------------------------------------------------------------------------------------- HTTP


def test_cache_events_and_snapshot_routes(client, engine):
    r = client.get("/cache_events")
    assert r.status_code == 200
    body = r.json()
    inc = engine.cache_events.incarnation
    assert body == {
        "incarnation": inc,
        "model": "smollm2-135m-instruct",
        "block_tokens": 16,
        "seq": 0,
        "gap": False,
        "events": [],
    }
    engine.cache_events.stored([1, 2**64 - 1])
    engine.cache_events.removed([1])
    engine.cache_events.cleared()
    body = client.get("/cache_events", params={"since": 0}).json()
    assert body["seq"] == 3 and not body["gap"]
    assert body["events"] == [
        {"seq": 1, "type": "stored", "blocks": [1, 2**64 - 1]},
        {"seq": 2, "type": "removed", "blocks": [1]},
        {"seq": 3, "type": "cleared", "blocks": []},
    ]
    assert [e["seq"] for e in client.get("/cache_events?since=2").json()["events"]] == [3]
    future = client.get("/cache_events?since=9").json()
    assert future["gap"] and future["events"] == [] and future["seq"] == 3
    for bad in ("x", "-1", "1.5", ""):
        r = client.get("/cache_events", params={"since": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "since", bad
    engine.cache_events.stored([7, 5])
    snap = client.get("/cache_snapshot").json()
    assert snap == {
        "incarnation": inc,
        "model": "smollm2-135m-instruct",
        "block_tokens": 16,
        "seq": 4,
        "blocks": [5, 7],
    }


def test_load_route(client, engine):
    engine.load.update(queued_requests=2, queued_prefill_tokens=300, running_requests=1, running_tokens=40)
    assert client.get("/load").json() == {
        "incarnation": engine.cache_events.incarnation,
        "queued_requests": 2,
        "queued_prefill_tokens": 300,
        "running_requests": 1,
        "running_tokens": 40,
        "max_total_tokens": 4096,
    }


def test_event_routes_are_404_when_events_are_off(tokenizer):
    c = TestClient(create_app(FakeEngine(tokenizer, cache_event_block_tokens=0), manage_engine=False))
    for r in (
        c.get("/cache_events"),
        c.get("/cache_snapshot"),
        c.post("/prefix_blocks", json={"endpoint": "generate", "request": {"input_ids": [1]}}),
    ):
        assert (
            r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and r.json()["error"]["code"] == 404
        )
    assert c.get("/load").json()["incarnation"] is None


def test_cache_routes_need_the_api_key(tokenizer):
    c = TestClient(create_app(FakeEngine(tokenizer, api_key="k"), manage_engine=False))
    calls = [("get", "/cache_events"), ("get", "/cache_snapshot"), ("get", "/load"), ("post", "/prefix_blocks")]
    for method, path in calls:
        r = c.request(method, path, json={"endpoint": "generate", "request": {"input_ids": [1]}})
        assert r.status_code == 401, path
        r = c.request(
            method,
            path,
            json={"endpoint": "generate", "request": {"input_ids": [1]}},
            headers={"authorization": "Bearer k"},
        )
        assert r.status_code == 200, (path, r.text)


def test_prefix_blocks_match_the_routers_prefix_keys(client, tokenizer):
    router = PrefixKeyExtractor(block_tokens=16, max_blocks=10_000)
    model = "smollm2-135m-instruct"
    router.set_tokenizer(model, tokenizer)
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " * 8},
        {"role": "user", "content": "Tell me about radix trees and how a prefix cache uses them. " * 3},
    ]
    cases = [
        ("chat", {"model": model, "messages": messages, "max_tokens": 5}),
        ("chat", {"messages": messages, "cache_salt": "ignored-by-the-engine"}),
        ("completions", {"model": model, "prompt": "Once upon a time, " * 20}),
        ("completions", {"prompt": ["first prompt " * 12, "second"]}),
        ("generate", {"text": "The quick brown fox jumps over the lazy dog. " * 6}),
        ("generate", {"input_ids": list(range(100, 160))}),
        ("generate", {"input_ids": [list(range(50)), [1, 2]]}),
    ]
    for endpoint, req in cases:
        r = client.post("/prefix_blocks", json={"endpoint": endpoint, "request": req})
        assert r.status_code == 200, r.text
        body = r.json()
        key = router.extract(endpoint, {k: v for k, v in req.items() if k != "cache_salt"}, model)
        assert key is not None
        assert body["model"] == model and body["block_tokens"] == 16
        assert body["blocks"] == list(key.blocks) and body["prompt_tokens"] == key.prompt_tokens, endpoint
        assert len(body["blocks"]) == body["prompt_tokens"] // 16 > 0


@pytest.mark.parametrize(
    ("payload", "status", "param"),
    [
        ({"endpoint": "nope", "request": {}}, 400, "endpoint"),
        ({"request": {"input_ids": [1]}}, 400, "endpoint"),
        ({"endpoint": "chat", "request": []}, 400, "request"),
        ({"endpoint": "chat", "request": {}}, 400, "request.messages"),
        (
            {"endpoint": "chat", "request": {"messages": [{"role": "wizard", "content": "x"}]}},
            400,
            "request.messages[0].role",
        ),
        ({"endpoint": "chat", "request": {"messages": "hi"}}, 400, "request.messages"),
        (
            {"endpoint": "chat", "request": {"model": "other", "messages": [{"role": "user", "content": "x"}]}},
            404,
            "request.model",
        ),
        ({"endpoint": "completions", "request": {"prompt": []}}, 400, "request.prompt"),
        ({"endpoint": "completions", "request": {"prompt": [10**9]}}, 400, "request.prompt"),
        ({"endpoint": "generate", "request": {"text": "a", "input_ids": [1]}}, 400, "request.text"),
        ({"endpoint": "generate", "request": {"text": 5}}, 400, "request.text"),
        ({"endpoint": "generate", "request": {"text": "\ud800"}}, 400, "request.text"),
    ],
)
def test_prefix_blocks_bad_input_is_a_4xx_error_body(client, payload, status, param):
    r = client.post("/prefix_blocks", content=json.dumps(payload), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"]


def test_prefix_blocks_body_that_is_not_an_object(client):
    r = client.post("/prefix_blocks", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object"


@requires_model
@pytest.mark.slow
def test_real_engine_publishes_the_blocks_of_a_served_chat_prompt():
    """The real model: after one chat request, /cache_snapshot holds every full block /prefix_blocks names for it,
    and the router's PrefixKey (with the engine's tokenizer) names the same blocks."""
    args = EngineArgs(
        model_path=MODEL_DIR, dtype="float32", context_length=1024, num_threads=2, max_total_tokens=4096, warmup=False
    )
    eng = Engine(args)
    eng.start()
    try:
        c = TestClient(create_app(eng, manage_engine=False))
        req = {
            "messages": [
                {"role": "system", "content": "You answer in one short sentence. " * 6},
                {"role": "user", "content": "What is a radix tree?"},
            ],
            "max_tokens": 3,
            "temperature": 0.0,
        }
        r = c.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        blocks = c.post("/prefix_blocks", json={"endpoint": "chat", "request": req}).json()
        assert blocks["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
        snap = c.get("/cache_snapshot").json()
        assert blocks["blocks"] and set(blocks["blocks"]) <= set(snap["blocks"])
        events = c.get("/cache_events", params={"since": 0}).json()
        live: set[int] = set()
        for ev in events["events"]:
            if ev["type"] == "stored":
                live |= set(ev["blocks"])
            elif ev["type"] == "removed":
                live -= set(ev["blocks"])
            else:
                live.clear()
        assert events["seq"] == snap["seq"] and live == set(snap["blocks"])
        router = PrefixKeyExtractor(block_tokens=args.cache_event_block_tokens, max_blocks=10_000)
        router.set_tokenizer(eng.served_model_name, eng.tokenizer)
        key = router.extract("chat", req, eng.served_model_name)
        assert key is not None and list(key.blocks) == blocks["blocks"]
        load = c.get("/load").json()
        assert load["incarnation"] == snap["incarnation"] and load["max_total_tokens"] == 4096
        assert load["queued_requests"] == 0 and load["running_requests"] == 0
    finally:
        eng.shutdown()
