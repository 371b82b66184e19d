"""Routing policies: the CHWBL ring (determinism, churn, ejection), the load bound, the prefix index, the simple
policies, and the issue's required properties simulated with the real key extractor and a load model."""

from __future__ import annotations

import os
import random
from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.router.policy import POLICIES, make_policy
from radixserve.router.policy.chwbl import PrefixHashPolicy, ring_hash
from radixserve.router.prefix_index import PrefixIndex
from radixserve.router.prefix_key import PrefixKeyExtractor
from radixserve.router.types import PrefixKey, WorkerLoad

from conftest import MODEL_DIR

MODEL = "smollm2-135m-instruct"


def urls(n: int, offset: int = 0) -> list[str]:
    return [f"http://10.0.0.{i + offset}:30000" for i in range(n)]


def key_of(routing_key: int, blocks: tuple[int, ...] = (), prompt_tokens: int = 100) -> PrefixKey:
    return PrefixKey("m", "tokens", blocks, routing_key, prompt_tokens, 16)


def idle(ws: list[str]) -> list[WorkerLoad]:
    return [WorkerLoad(u) for u in ws]


def owners(policy: PrefixHashPolicy, keys: list[int], ws: list[str]) -> list[str]:
    return [policy.rank(key_of(k), idle(ws), 10)[0].worker for k in keys]


# ---------------------------------------------------------------------------------------------------- ring


def test_ring_owner_is_the_first_point_clockwise():
    """Checked against a brute-force ring: the owner holds the first virtual node at or after the key (wrapping)."""
    ws = urls(5)
    policy = PrefixHashPolicy(virtual_nodes=16)
    policy.set_workers(ws)
    rng = random.Random(1)
    points = [(ring_hash(f"{u}#{i}"), u) for u in ws for i in range(16)]
    for _ in range(300):
        k = rng.getrandbits(64)
        expected = min(points, key=lambda p: ((p[0] - k) % 2**64, p[1]))[1]
        ranking = policy.rank(key_of(k), idle(ws), 10)
        assert ranking[0].worker == expected and ranking[0].reason == "cold"  # nothing recorded: a fresh prompt
        assert sorted(d.worker for d in ranking) == sorted(ws)


def test_ring_is_deterministic_across_instances_and_input_order():
    ws = urls(6)
    a, b = PrefixHashPolicy(), PrefixHashPolicy()
    a.set_workers(ws)
    b.set_workers(list(reversed(ws)) + ws[:2])  # order and duplicates do not matter
    keys = [random.Random(2).getrandbits(64) for _ in range(500)]
    assert [a.walk(k, ws) for k in keys] == [b.walk(k, ws) for k in keys]


def test_churn_moves_about_one_nth_of_the_keys():
    n = 10
    ws = urls(n)
    rng = random.Random(3)
    keys = [rng.getrandbits(64) for _ in range(10_000)]
    policy = PrefixHashPolicy(virtual_nodes=256)
    policy.set_workers(ws)
    before = owners(policy, keys, ws)
    assert min(Counter(before).values()) > 0.5 * len(keys) / n  # balanced ring

    # a worker leaves: only its keys move, and they are about 1/N of all
    gone = ws[4]
    policy.set_workers([u for u in ws if u != gone])
    after = owners(policy, keys, [u for u in ws if u != gone])
    moved = [i for i, (x, y) in enumerate(zip(before, after)) if x != y]
    assert all(before[i] == gone for i in moved) and before.count(gone) == len(moved)
    assert 0.5 / n <= len(moved) / len(keys) <= 1.5 / n

    # a worker joins: only keys that move to it move, about 1/(N+1)
    new = urls(1, offset=50)[0]
    policy.set_workers(ws + [new])
    joined = owners(policy, keys, ws + [new])
    moved = [i for i, (x, y) in enumerate(zip(before, joined)) if x != y]
    assert all(joined[i] == new for i in moved)
    assert 0.5 / (n + 1) <= len(moved) / len(keys) <= 1.5 / (n + 1)


def test_ejected_worker_gets_exactly_its_keys_back():
    """Ejection = the worker is missing from ``rank``'s workers while the ring keeps it: its keys spread over the
    others (which keep theirs); readmitted, it owns exactly the same keys again."""
    ws = urls(8)
    rng = random.Random(4)
    keys = [rng.getrandbits(64) for _ in range(3000)]
    policy = PrefixHashPolicy()
    policy.set_workers(ws)
    before = owners(policy, keys, ws)
    ejected = ws[2]
    live = [u for u in ws if u != ejected]
    during = owners(policy, keys, live)
    assert ejected not in during
    assert all(d == b for d, b in zip(during, before) if b != ejected)
    assert len({d for d, b in zip(during, before) if b == ejected}) > 1  # its keys spread, not all to one worker
    assert owners(policy, keys, ws) == before


# ---------------------------------------------------------------------------------------------------- bounded load


def fits(load: int, cost: int, loads: list[int], slack: int, load_factor: float = 1.25) -> bool:
    """The CHWBL bound in tokens, or within ``slack`` tokens of the least loaded worker."""
    return load + cost <= load_factor * (sum(loads) + cost) / len(loads) or load - min(loads) <= slack


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(st.integers(0, 20_000), min_size=1, max_size=8),
    cost=st.integers(0, 8000),
    routing_key=st.integers(0, 2**64 - 1),
    ring_extra=st.integers(0, 3),
    slack=st.sampled_from([0, 500, 2048]),
)
def test_choice_is_the_first_fitting_worker_clockwise(loads, cost, routing_key, ring_extra, slack):
    ws = urls(len(loads))
    policy = PrefixHashPolicy(virtual_nodes=32, balance_abs_tokens=slack)
    policy.set_workers(ws + urls(ring_extra, offset=100))  # ring members that are not routable (ejected, other model)
    workers = [WorkerLoad(u, inflight_requests=load // 100, inflight_tokens=load) for u, load in zip(ws, loads)]
    ranking = policy.rank(key_of(routing_key), workers, cost)
    assert sorted(d.worker for d in ranking) == sorted(ws)  # everyone once
    walk = policy.walk(routing_key, ws)
    load_of = dict(zip(ws, loads))
    choice = ranking[0].worker
    assert fits(load_of[choice], cost, loads, slack)
    skipped = walk[: walk.index(choice)]
    assert not any(fits(load_of[u], cost, loads, slack) for u in skipped)  # no fitting worker skipped
    assert ranking[0].reason == ("cold" if choice == walk[0] else "load-spill")  # nothing recorded
    assert [d.worker for d in ranking[1:]] == [u for u in walk if u != choice]


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.integers(0, 20_000), min_size=2, max_size=6),
    cost=st.integers(1, 8000),
    recorded=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12)), max_size=10),
    slack=st.sampled_from([0, 500, 2048]),
)
def test_affinity_picks_the_longest_match_among_fitting_workers(loads, cost, recorded, slack):
    """With recorded prefixes, the choice fits the bound (its cost being the request's tokens minus what it is
    predicted to hold) and no fitting worker holds a longer prefix."""
    ws = urls(len(loads))
    policy = PrefixHashPolicy(virtual_nodes=32, balance_abs_tokens=slack)
    policy.set_workers(ws)
    blocks = tuple(random.Random(len(loads)).getrandbits(64) for _ in range(12))
    for w, n in recorded:
        policy.record(ws[w % len(ws)], key_of(0, blocks[:n]))
    key = key_of(blocks[3], blocks, prompt_tokens=12 * 16 + 5)
    workers = [WorkerLoad(u, inflight_tokens=load) for u, load in zip(ws, loads)]
    ranking = policy.rank(key, workers, cost)
    load_of = dict(zip(ws, loads))
    choice = ranking[0].worker
    matched = {u: policy.index.match(u, blocks) for u in ws}
    cost_of = {u: max(0, cost - min(matched[u] * 16, key.prompt_tokens - 1)) for u in ws}
    assert fits(load_of[choice], cost_of[choice], loads, slack)
    assert all(matched[u] <= matched[choice] for u in ws if fits(load_of[u], cost_of[u], loads, slack))
    for d in ranking:
        assert d.predicted_cached_tokens == min(matched[d.worker] * 16, key.prompt_tokens - 1)
    owner = policy.walk(key.routing_key, ws)[0]
    # Issue 11: "cache-affinity" only for a worker predicted to hold some of the prompt; the owner of a prompt nobody
    # holds is "cold" (it said "prefix-hit" on requests the engine answered with cached_tokens 0).
    if matched[choice]:
        expected = "cache-affinity"
    elif choice == owner and not any(matched.values()):
        expected = "cold"
    else:
        expected = "load-spill"
    assert ranking[0].reason == expected


def test_route_reasons_say_what_the_router_knows():
    """Issue 11: a fresh prompt is "cold" (it said "prefix-hit"), the same prompt again "cache-affinity"; a prompt
    whose holder is over the load bound goes elsewhere as "load-spill"."""
    ws = urls(3)
    policy = PrefixHashPolicy(virtual_nodes=32, balance_abs_tokens=0)
    policy.set_workers(ws)
    key = key_of(11, (11, 22, 33), prompt_tokens=50)
    first = policy.rank(key, idle(ws), 60)[0]
    assert first.reason == "cold" and first.predicted_cached_tokens == 0
    policy.record(first.worker, key)
    again = policy.rank(key, idle(ws), 60)[0]
    assert (again.worker, again.reason, again.predicted_cached_tokens) == (first.worker, "cache-affinity", 48)
    loads = [WorkerLoad(u, inflight_tokens=10_000 if u == first.worker else 0) for u in ws]
    spilled = policy.rank(key, loads, 60)[0]
    assert spilled.worker != first.worker and spilled.reason == "load-spill"


@pytest.mark.parametrize(("threshold", "expected"), [(0.5, "cold"), (0.25, "cache-affinity"), (0.0, "cache-affinity")])
def test_a_match_is_affinity_only_from_the_cache_threshold_on(threshold, expected):
    """A worker holding 1 of a prompt's 4 blocks wins it only when 1/4 reaches ``cache_threshold``; else the prompt is
    cold on its key's owner (0: any match counts, the behaviour before the threshold)."""
    ws = urls(2)
    policy = PrefixHashPolicy(virtual_nodes=32, cache_threshold=threshold)
    policy.set_workers(ws)
    key = key_of(7, (11, 22, 33, 44), prompt_tokens=70)
    owner = policy.walk(key.routing_key, ws)[0]
    other = next(u for u in ws if u != owner)
    policy.record(other, key_of(0, key.blocks[:1]))
    first = policy.rank(key, idle(ws), 10)[0]
    assert (first.worker, first.reason) == ((owner, "cold") if expected == "cold" else (other, "cache-affinity"))
    assert first.predicted_cached_tokens == (0 if expected == "cold" else 16)


def test_no_key_routes_to_the_least_loaded():
    policy = make_policy("prefix_hash")
    ws = urls(3)
    policy.set_workers(ws)
    workers = [WorkerLoad(ws[0], 1, 500), WorkerLoad(ws[1], 3, 200), WorkerLoad(ws[2], 1, 200)]
    ranking = policy.rank(None, workers, 50)
    assert [d.worker for d in ranking] == [ws[2], ws[1], ws[0]]
    assert {d.reason for d in ranking} == {"fallback"} and all(d.predicted_cached_tokens == 0 for d in ranking)
    assert policy.rank(key_of(1), [], 10) == []


# ---------------------------------------------------------------------------------------------------- prefix index


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 20)), min_size=1, max_size=40),
    capacity=st.integers(1, 30),
    probe=st.tuples(st.integers(0, 5), st.integers(0, 20)),
)
def test_prefix_index_match_equals_a_linear_walk(ops, capacity, probe):
    """Chains share prefixes (chain c's first blocks are chain 0's); under LRU eviction the recorded set stays
    prefix-closed, so the binary search equals walking to the first miss, and capacity is never exceeded."""
    chains = [[("shared", i) if i < 4 + c else (c, i) for i in range(20)] for c in range(6)]
    hashed = [[hash(b) for b in chain] for chain in chains]
    index = PrefixIndex(capacity)
    for c, n in ops:
        index.record("w", hashed[c][:n])
        assert index.size("w") <= capacity
    c, n = probe
    blocks = hashed[c][:n]
    present = [index.match("w", [h]) == 1 for h in blocks]  # one-block queries: plain membership
    linear = present.index(False) if False in present else len(present)
    assert index.match("w", blocks) == linear
    assert index.match("other", blocks) == 0
    # the last recorded prefix is fully present when it fits the capacity
    last_c, last_n = ops[-1]
    if last_n <= capacity:
        assert index.match("w", hashed[last_c][:last_n]) == last_n
    index.forget("w")
    assert index.match("w", blocks) == 0


def test_prefix_index_evicts_least_recently_used_prefixes():
    index = PrefixIndex(capacity_blocks_per_worker=6)
    a, b, c = [1, 2, 3], [10, 20, 30], [100, 200, 300]
    index.record("w", a)
    index.record("w", b)
    index.record("w", a)  # a is now the most recent
    index.record("w", c)  # evicts b, deepest block first
    assert index.match("w", a) == 3 and index.match("w", c) == 3 and index.match("w", b) == 0


# ---------------------------------------------------------------------------------------------------- simple policies


def test_make_policy_names():
    for name in POLICIES:
        assert make_policy(name, seed=0).name == name
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError):
        make_policy("prefix_hash", load_factor=0.5)
    with pytest.raises(ValueError, match="cache_threshold"):
        make_policy("prefix_hash", cache_threshold=1.01)


def test_round_robin_cycles():
    policy = make_policy("round_robin")
    ws = urls(3)
    workers = [WorkerLoad(u, inflight_tokens=t) for u, t in zip(ws, (900, 0, 5))]  # load is ignored
    firsts = [policy.rank(None, workers, 10)[0].worker for _ in range(6)]
    assert firsts == sorted(ws) * 2
    ranking = policy.rank(None, list(reversed(workers)), 10)
    assert [d.worker for d in ranking] == sorted(ws)  # continues the rotation, whatever the input order
    assert {d.reason for d in ranking} == {"fallback"}


def test_least_load_picks_the_minimum():
    policy = make_policy("least_load")
    rng = random.Random(5)
    for _ in range(50):
        workers = [WorkerLoad(u, rng.randint(0, 3), rng.randint(0, 5) * 100) for u in urls(5)]
        ranking = policy.rank(None, workers, 10)
        loads = [(w.inflight_tokens, w.inflight_requests, w.url) for w in workers]
        assert [d.worker for d in ranking] == [u for _, _, u in sorted(loads)]


def test_power_of_two_takes_the_lower_of_its_samples():
    policy = make_policy("power_of_two", seed=7)
    ws = urls(4)
    workers = [WorkerLoad(u, inflight_tokens=t) for u, t in zip(ws, (10, 20, 30, 40))]
    firsts = Counter()
    for _ in range(400):
        ranking = policy.rank(None, workers, 10)
        assert sorted(d.worker for d in ranking) == sorted(ws)
        loads = {w.url: w.inflight_tokens for w in workers}
        assert loads[ranking[0].worker] < loads[ranking[1].worker]  # the better of the two samples first
        firsts[ranking[0].worker] += 1
    assert ws[3] not in firsts  # the most loaded never wins a pair
    assert firsts[ws[0]] > firsts[ws[1]] > firsts[ws[2]] > 0  # P(first) = 3/6, 2/6, 1/6
    assert [d.worker for d in make_policy("power_of_two").rank(None, workers[:1], 5)] == [ws[0]]


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_predicts_cached_tokens_from_what_it_sent(name):
    policy = make_policy(name, seed=0)
    ws = urls(3)
    policy.set_workers(ws)
    blocks = (11, 22, 33, 44)
    policy.record(ws[1], key_of(0, blocks[:3]))
    key = key_of(44, blocks, prompt_tokens=60)
    predicted = {d.worker: d.predicted_cached_tokens for d in policy.rank(key, idle(ws), 10)}
    assert predicted == {ws[0]: 0, ws[1]: 48, ws[2]: 0}
    policy.record(ws[1], key)
    assert {d.worker: d.predicted_cached_tokens for d in policy.rank(key, idle(ws), 10)}[
        ws[1]
    ] == 59  # 4 blocks = 64 tokens, capped at prompt - 1
    policy.forget_worker(ws[1])
    assert all(d.predicted_cached_tokens == 0 for d in policy.rank(key, idle(ws), 10))


# -------------------------------------------------------------------------------------------------- required properties

WORDS = (
    "train ticket museum river bridge harbor castle market garden station coffee bakery ancient modern quiet busy "
    "north south evening morning weekend holiday family student journey mountain valley island village city"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


@pytest.fixture(params=["tokens", "chars"])
def extractor(request) -> PrefixKeyExtractor:
    """The real key extractor: on the demo model's tokens when it is converted, and on characters."""
    ex = PrefixKeyExtractor(block_tokens=16, block_chars=64, prefix_blocks=8)
    if request.param == "tokens":
        if not os.path.exists(os.path.join(MODEL_DIR, "config.json")):
            pytest.skip("demo model not converted; run `make install`")
        from transformers import AutoTokenizer

        ex.set_tokenizer(MODEL, AutoTokenizer.from_pretrained(MODEL_DIR))
    return ex


class LoadModel:
    """Workers with in-flight tokens: each routed request adds (prompt - predicted cached + max_tokens) to its worker
    and finishes once ``concurrency`` later requests were routed (FIFO)."""

    def __init__(self, policy, ws: list[str], concurrency: int, max_tokens: int = 64):
        self.policy, self.concurrency, self.max_tokens = policy, concurrency, max_tokens
        self.loads = {u: WorkerLoad(u) for u in ws}
        self.inflight: deque[tuple[str, int]] = deque()

    def route(self, key: PrefixKey):
        while len(self.inflight) >= self.concurrency:
            url, cost = self.inflight.popleft()
            self.loads[url].inflight_requests -= 1
            self.loads[url].inflight_tokens -= cost
        cost = key.prompt_tokens + self.max_tokens
        snapshot = {u: w.inflight_tokens for u, w in self.loads.items()}
        # Each worker's cost for this request: what it would have to compute (tokens it is not predicted to hold).
        cost_on = {u: cost - self.policy.predicted_cached_tokens(u, key) for u in self.loads}
        decision = self.policy.rank(key, list(self.loads.values()), cost)[0]
        added = cost - decision.predicted_cached_tokens
        self.loads[decision.worker].inflight_requests += 1
        self.loads[decision.worker].inflight_tokens += added
        self.inflight.append((decision.worker, added))
        self.policy.record(decision.worker, key)
        return decision, snapshot, cost_on


@pytest.mark.parametrize("slack", [0, 2048])
@pytest.mark.parametrize("system", [True, False], ids=["own-system-prompt", "no-system-prompt"])
@pytest.mark.parametrize("concurrency", [1, 6])
def test_turn_n_plus_1_follows_turn_n_whenever_load_allows(extractor, system, concurrency, slack):
    """16 conversations × 4 turns, interleaved, 4 workers: each turn goes to the previous turn's worker whenever that
    worker fits the load bound (with no concurrency: always) and holds at least the cache threshold (half) of the new
    prompt's blocks, as it does once a conversation is past its first turns; a turn that more than doubles a short
    prompt is routed as a fresh one, ``cold`` on its key's owner."""
    rng = random.Random(6)
    ws = urls(4)
    policy = make_policy("prefix_hash", balance_abs_tokens=slack)
    policy.set_workers(ws)
    sim = LoadModel(policy, ws, concurrency)
    convs = [
        [{"role": "system", "content": f"Conversation {c}. " + sentence(rng, 40)}] if system else [] for c in range(16)
    ]
    last: dict[int, str] = {}
    checked = stuck = below = 0
    for turn in range(4):
        for c in rng.sample(range(16), 16):
            convs[c].append({"role": "user", "content": f"Question {c}.{turn}: " + sentence(rng, 25)})
            key = extractor.extract("chat", {"model": MODEL, "messages": convs[c]}, MODEL)
            assert key is not None
            held = policy.index.match(last[c], key.blocks) / len(key.blocks) if c in last else 0.0
            owner = policy.walk(key.routing_key, ws)[0]
            decision, loads, cost_on = sim.route(key)
            if c in last and held < 0.5:
                below += 1
                if fits(loads[owner], cost_on[owner], list(loads.values()), slack):
                    assert (decision.worker, decision.reason) == (owner, "cold")
            elif c in last and fits(loads[last[c]], cost_on[last[c]], list(loads.values()), slack):
                checked += 1
                stuck += decision.worker == last[c]
                assert decision.reason == "cache-affinity"
            last[c] = decision.worker
            convs[c].append({"role": "assistant", "content": sentence(rng, 20)})
    # Only a second turn can double its conversation here; the loaded run really exercised the property, the
    # absolute slack keeps most turns within the bound.
    assert below <= 16
    assert checked >= (48 - below if concurrency == 1 else 40 - below if slack else 8)
    assert stuck == checked


# SmolLM2's chat template puts this system prompt first in every chat that has none: ~25 tokens, one shared block.
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
NEWCOMER_WORDS = (
    "apple river mountain code kernel token cache tree router engine galaxy piano violin ocean desert forest"
)


def newcomer_chat(i: int) -> dict:
    """Chat ``i`` of the newcomer's trial (their dist.py): a 200-word user message after the system prompt."""
    rng = random.Random(i)
    text = " ".join(rng.choice(NEWCOMER_WORDS.split()) for _ in range(200))
    messages = [{"role": "system", "content": SMOLLM_SYSTEM}, {"role": "user", "content": f"{i} {text}"}]
    return {"model": MODEL, "messages": messages}


def test_fresh_chats_sharing_a_system_prompt_block_spread_over_workers_as_cold(extractor):
    """Regression (newcomer trial, round 2): ten different 200-word chats all went to one of two engines, labelled
    cache-affinity: the engine that served the first held the template's system-prompt block, and any match won. A
    match under ``cache_threshold`` (half the prompt's blocks) is no affinity: each chat goes cold to its own key's
    owner. The same chat again goes back to its engine, as cache-affinity."""
    ws = urls(2)
    policy = make_policy("prefix_hash")
    policy.set_workers(ws)
    sim = LoadModel(policy, ws, concurrency=1)
    keys = [extractor.extract("chat", newcomer_chat(i), MODEL) for i in range(10)]
    assert len({k.blocks[0] for k in keys}) == 1 and len({k.blocks[1] for k in keys}) == 10  # one shared block
    decisions = [sim.route(k)[0] for k in keys]
    assert [d.reason for d in decisions] == ["cold"] * 10
    assert [d.worker for d in decisions] == [policy.walk(k.routing_key, ws)[0] for k in keys]
    assert {d.worker for d in decisions} == set(ws)  # not all on one
    again = sim.route(keys[3])[0]
    assert (again.worker, again.reason) == (decisions[3].worker, "cache-affinity")


def test_short_prompts_spread_over_workers(extractor):
    """Regression (newcomer trial, round 2): every prompt shorter than one block had the namespace hash as its routing
    key, so the 8 parallel completions of their load.py (9 tokens each) all went to one engine. The key now
    hashes the partial block: distinct short prompts get distinct keys, the same prompt the same one."""
    prompts = [f"Story number {i}: Once upon a time" for i in range(8)]
    keys = [extractor.extract("completions", {"model": MODEL, "prompt": p}, MODEL) for p in prompts]
    assert all(k.blocks == () for k in keys)
    assert len({k.routing_key for k in keys}) == 8
    assert extractor.extract("completions", {"model": MODEL, "prompt": prompts[0]}, MODEL) == keys[0]
    ws = urls(2)
    policy = make_policy("prefix_hash")
    policy.set_workers(ws)
    decisions = [policy.rank(k, idle(ws), 120)[0] for k in keys]
    assert {d.reason for d in decisions} == {"cold"} and {d.worker for d in decisions} == set(ws)


def test_shared_system_prompt_stays_on_its_worker_until_load_spills(extractor):
    """Conversations sharing only a long system prompt (more than K blocks) share its routing key, so they all go
    to its owner while the owner fits, and spill to other workers ("load-spill") when it does not."""
    rng = random.Random(8)
    ws = urls(4)
    system = "Shared instructions: " + sentence(rng, 160)
    bodies = [
        {"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"{c} " + sentence(rng, 12)}]}
        for c in range(40)
    ]
    keys = [extractor.extract("chat", b, MODEL) for b in bodies]
    assert all(len(k.blocks) > 8 for k in keys)
    assert len({k.routing_key for k in keys}) == 1  # only the system prompt is in the first K blocks

    # unloaded: one worker takes them all
    sequential = make_policy("prefix_hash")
    sequential.set_workers(ws)
    seq = LoadModel(sequential, ws, concurrency=1)
    owner = sequential.rank(keys[0], idle(ws), 1)[0].worker
    assert all(seq.route(k)[0].worker == owner for k in keys)

    # loaded: the owner takes every request it fits, the others spill (no absolute slack, so the bound bites at
    # these small loads)
    policy = make_policy("prefix_hash", balance_abs_tokens=0)
    policy.set_workers(ws)
    sim = LoadModel(policy, ws, concurrency=8)
    reasons, chosen = [], Counter()
    for i, k in enumerate(keys):
        decision, loads, cost_on = sim.route(k)
        chosen[decision.worker] += 1
        if fits(loads[owner], cost_on[owner], list(loads.values()), 0):
            assert decision.worker == owner and decision.reason == ("cold" if i == 0 else "cache-affinity")
        else:
            assert decision.worker != owner
            reasons.append(decision.reason)
    assert reasons and reasons[0] == "load-spill"
    assert chosen.most_common(1)[0][0] == owner and len(chosen) > 1


def test_engine_reported_kv_tokens_do_not_count_as_this_routers_load():
    """Regression (issue 13 bench): load was max(in-flight tokens, the engine's queued prefill + KV tokens), and KV
    tokens count the cached prefixes running requests hold, so an engine with 2 conversations of ~600 KV tokens each
    looked 2,400 tokens busier than it was and conversations spilled off it (hit rate 0.74 -> 0.67). Only the
    engine's request count adds load: other routers' requests, at this router's mean cost per request."""
    mine = WorkerLoad("http://a", inflight_requests=2, inflight_tokens=600, engine_tokens=5000, engine_requests=2)
    assert mine.load == 600
    shared = WorkerLoad("http://a", inflight_requests=2, inflight_tokens=600, engine_tokens=9000, engine_requests=4)
    assert shared.load == 1200 and shared.requests == 4
    other_routers_only = WorkerLoad("http://b", engine_tokens=9000, engine_requests=3, mean_request_tokens=250.0)
    assert other_routers_only.load == 750
    assert WorkerLoad("http://c", inflight_requests=1, inflight_tokens=90).load == 90  # no /load report


def test_a_conversation_stays_on_its_engine_whatever_kv_that_engine_reports(extractor):
    ws = [f"http://w{i}" for i in range(2)]
    policy = make_policy("prefix_hash")
    policy.set_workers(ws)
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": "rules " * 300}, {"role": "user", "content": "hi"}],
    }
    key = extractor.extract("chat", body, "m")
    first = policy.rank(key, [WorkerLoad(u) for u in ws], 400)[0].worker
    policy.record(first, key)
    other = next(u for u in ws if u != first)
    loads = [
        WorkerLoad(first, 3, 900, engine_tokens=4000, engine_requests=3),
        WorkerLoad(other, 0, 0, engine_tokens=0, engine_requests=0),
    ]
    assert policy.rank(key, loads, 400)[0].worker == first
