"""Hot-prefix replication: the demand tracker (grow, shrink, hysteresis) and the policy on simulated load, with the
real key extractor: a hot system prompt spreads over engines with one warm-up prefill per new replica, cold groups
keep one owner, two routers with the same view decide alike."""

from __future__ import annotations

import concurrent.futures
import random
from collections import Counter

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.router.policy import make_policy
from radixserve.router.policy.hot_prefix import HotPrefixTracker
from radixserve.router.types import PrefixKey, WorkerLoad
from test_router_app import engines, router, tok  # noqa: F401 - tok is a fixture
from test_router_policy import MODEL, LoadModel, extractor, sentence, urls  # noqa: F401 - extractor is a fixture


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_group_with_all_the_demand_gets_every_worker_and_a_lone_request_none():
    clock = Clock()
    hot = HotPrefixTracker(half_life_s=10.0, clock=clock)
    hot.observe(1, 800)
    assert hot.replicas(1, 4) == 1  # one request: no second prefill for it
    hot.observe(1, 800)
    assert hot.share(1) == pytest.approx(1.0)
    assert hot.replicas(1, 4) == 4
    assert hot.replicas(1, 1) == 1


@settings(max_examples=60, deadline=None)
@given(hot_share=st.floats(0.05, 0.95), n=st.integers(2, 8))
def test_replicas_follow_the_share_in_fair_shares(hot_share, n):
    """Demand split hot_share : (1 - hot_share) between a hot group and many one-request groups: the hot group
    wants ceil(share * n) replicas."""
    clock = Clock()
    hot = HotPrefixTracker(half_life_s=1e9, clock=clock)  # no decay: exact shares
    for i in range(200):
        hot.observe(0, round(1000 * hot_share))
        hot.observe(i + 1, round(1000 * (1 - hot_share)))
    share = hot.share(0)
    assert share == pytest.approx(hot_share, abs=0.01)
    r = hot.replicas(0, n)
    assert r == max(1, min(n, -(-share * n // 1)))  # ceil
    assert hot.replicas(5, n) == 1


def test_a_cooling_group_shrinks_one_replica_at_a_time_with_hysteresis():
    clock = Clock()
    hot = HotPrefixTracker(half_life_s=10.0, shrink_ratio=0.75, clock=clock)
    for _ in range(10):
        hot.observe(1, 500)
    assert hot.replicas(1, 3) == 3
    seen = [3]
    # Another group takes over the traffic: group 1's demand decays, its share falls.
    for step in range(200):
        clock.t += 1.0
        hot.observe(1000 + step % 7, 500)
        seen.append(hot.replicas(1, 3))
    assert seen[-1] == 1
    assert all(a - b in (0, 1) for a, b in zip(seen, seen[1:], strict=False)), "shrinks one at a time, never grows"
    # At the boundary it does not flap: share * n just under the current count keeps it.
    hot2 = HotPrefixTracker(half_life_s=1e9, clock=clock)
    for i in range(100):
        hot2.observe(1, 100)
        hot2.observe(2 + i, 100)  # share 0.5: on 2 workers exactly one fair share
    assert hot2.replicas(1, 2) == 1
    for _ in range(10):
        hot2.observe(1, 100)  # share > 0.5: grows to 2
    assert hot2.replicas(1, 2) == 2
    for i in range(12):
        hot2.observe(500 + i, 100)  # back to about 0.5: stays 2 (shrinks only below 0.75 of one share)
    assert 0.45 < hot2.share(1) < 0.55 and hot2.replicas(1, 2) == 2


def test_half_life_zero_disables_and_bad_arguments_are_refused():
    hot = HotPrefixTracker(half_life_s=0)
    for _ in range(5):
        hot.observe(1, 100)
    assert hot.replicas(1, 4) == 1 and not hot.enabled
    with pytest.raises(ValueError):
        HotPrefixTracker(half_life_s=-1)
    with pytest.raises(ValueError):
        HotPrefixTracker(shrink_ratio=0)
    with pytest.raises(ValueError):
        HotPrefixTracker(max_groups=0)


def test_tracked_groups_are_bounded():
    hot = HotPrefixTracker(max_groups=16)
    for g in range(1000):
        hot.observe(g, 10)
    assert len(hot._groups) == 16


# ------------------------------------------------------------------------------------------------ policy, simulated


def chat_keys(extractor, n: int, seed: int = 3) -> list[PrefixKey]:
    """Workload (a) of the benchmarks: ``n`` chats sharing a ~500-token system prompt, distinct short user turns."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + " ".join(sentence(rng, 12) for _ in range(30))
    bodies = [
        {"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"{i} " + sentence(rng, 10)}]}
        for i in range(n)
    ]
    keys = [extractor.extract("chat", b, MODEL) for b in bodies]
    assert len({k.routing_key for k in keys}) == 1 and all(len(k.blocks) > 16 for k in keys)
    return keys


def hot_policy(ws: list[str], half_life_s: float = 10.0):
    policy = make_policy("prefix_hash", hot_prefix_half_life_s=half_life_s)
    policy.set_workers(ws)
    return policy


def test_a_hot_system_prompt_spreads_over_the_workers_with_one_warmup_each(extractor):
    """Regression (issue 13): workload (a) put every request on one of two engines (the shared system prompt's
    owner; the load bound's slack let them pile up) while the other idled. With replication both take a fair part,
    and the prompt is prefilled once per engine: cold on the owner, one ``hot-prefix`` warm-up on the replica."""
    ws = urls(2)
    keys = chat_keys(extractor, 32)
    sim = LoadModel(hot_policy(ws), ws, concurrency=8)
    decisions = [sim.route(k)[0] for k in keys]
    reasons = Counter(d.reason for d in decisions)
    assert reasons["cold"] == 1 and reasons["hot-prefix"] == 1, reasons
    assert reasons["cache-affinity"] == 30
    per_worker = Counter(d.worker for d in decisions)
    assert set(per_worker) == set(ws) and min(per_worker.values()) >= 12, per_worker
    # The same workload without replication: one engine takes it all.
    off = LoadModel(hot_policy(ws, half_life_s=0), ws, concurrency=8)
    assert len({off.route(k)[0].worker for k in keys}) == 1


def test_one_request_at_a_time_stays_on_one_worker(extractor):
    """A user sending one request at a time (each done before the next) has the whole demand but never more than
    one request in flight: no replica is warmed for it (regression: the same prompt sent 4 times in a row went to
    both engines)."""
    ws = urls(2)
    sim = LoadModel(hot_policy(ws), ws, concurrency=1)
    decisions = [sim.route(k)[0] for k in chat_keys(extractor, 12)]
    assert len({d.worker for d in decisions}) == 1
    assert "hot-prefix" not in {d.reason for d in decisions}


def test_a_cold_burst_prefills_the_prefix_once_per_replica(extractor):
    """A burst of 8 requests sharing a cold prefix, none finished yet: the first goes to the owner, one warms the
    second replica, the rest follow them (cache-affinity), not 8 prefills on 2 engines."""
    ws = urls(4)
    keys = chat_keys(extractor, 8, seed=5)
    policy = hot_policy(ws)
    sim = LoadModel(policy, ws, concurrency=100)
    decisions = [sim.route(k)[0] for k in keys]
    prefills = [d for d in decisions if d.reason in ("cold", "hot-prefix")]
    assert len(prefills) == len({d.worker for d in decisions}) <= 4
    assert decisions[0].reason == "cold" and decisions[0].worker == policy.walk(keys[0].routing_key, ws)[0]
    # Replicas are the ring walk's first workers, in order.
    walk = policy.walk(keys[0].routing_key, ws)
    assert [d.worker for d in prefills] == walk[: len(prefills)]


def test_cold_groups_keep_one_owner_beside_a_hot_one(extractor):
    """Workload (d): 60% of requests share one hot system prompt, 40% are distinct conversations: each distinct
    conversation stays on its ring owner (one replica), turn after turn, while the hot one is replicated."""
    ws = urls(3)
    rng = random.Random(11)
    hot_keys = chat_keys(extractor, 60, seed=7)
    convs = {
        c: [{"role": "system", "content": f"Conversation {c}. " + " ".join(sentence(rng, 12) for _ in range(12))}]
        for c in range(8)
    }
    policy = hot_policy(ws)
    sim = LoadModel(policy, ws, concurrency=6)
    where: dict[int, set[str]] = {c: set() for c in convs}
    hot_workers: Counter[str] = Counter()
    h = 0
    for turn in range(5):
        for c, messages in convs.items():
            messages.append({"role": "user", "content": sentence(rng, 8)})
            key = extractor.extract("chat", {"messages": list(messages)}, MODEL)
            d = sim.route(key)[0]
            where[c].add(d.worker)
            messages.append({"role": "assistant", "content": sentence(rng, 8)})
            for _ in range(2 if turn < 4 else 4):  # 12 hot requests per round of 8 conversations
                if h < len(hot_keys):
                    hot_workers[sim.route(hot_keys[h])[0].worker] += 1
                    h += 1
    assert all(len(w) == 1 for w in where.values()), where
    assert len(hot_workers) >= 2, hot_workers
    assert policy.hot_prefix is not None and policy.hot_prefix.hot_groups() == 1


def test_replicas_choose_by_predicted_cost_uncached_tokens_plus_load():
    ws = urls(2)
    policy = hot_policy(ws)
    head = tuple(range(1, 41))
    key = PrefixKey("m", "tokens", head, 77, 650, 16)
    walk = policy.walk(77, ws)
    for w in walk:  # both replicas hold the head
        policy.record(w, key)
    loads = [WorkerLoad(walk[0], 3, 900), WorkerLoad(walk[1], 1, 300)]
    d = policy.rank(key, loads, 700)[0]
    assert (d.worker, d.reason) == (walk[1], "cache-affinity")
    # A later turn of one conversation: its own replica holds 200 more tokens, which outweighs 150 tokens of load.
    longer = PrefixKey("m", "tokens", (*head, *range(100, 113)), 77, 850, 16)
    policy.index.record(walk[0], longer.blocks)
    loads = [WorkerLoad(walk[0], 2, 450), WorkerLoad(walk[1], 1, 300)]
    assert policy.rank(longer, loads, 900)[0].worker == walk[0]


def test_two_routers_with_the_same_view_route_alike(extractor):
    """Router replicas share no state: given the same requests and the same engine-reported load, they choose the
    same engine for every request."""
    ws = urls(3)
    keys = chat_keys(extractor, 24, seed=9)
    clock = Clock()
    a, b = hot_policy(ws), hot_policy(ws)
    for p in (a, b):
        assert p.hot_prefix is not None
        p.hot_prefix.clock = clock
    rng = random.Random(2)
    for k in keys:
        clock.t += 0.1
        reported = {u: rng.randrange(0, 6) for u in ws}
        loads = [WorkerLoad(u, 0, 0, engine_requests=reported[u], mean_request_tokens=700.0) for u in ws]
        da, db = a.rank(k, loads, 700)[0], b.rank(k, loads, 700)[0]
        assert da == db
        a.record(da.worker, k)
        b.record(db.worker, k)


# ------------------------------------------------------------------------------------------------ through the router


def test_a_burst_of_non_streaming_requests_prefills_the_hot_prefix_once_per_engine(tok):
    """Regression (issue 13): the router recorded a request's blocks when the engine's answer started, which for a
    non-streaming request is when it is done: every request of a burst sharing a cold prefix saw no engine holding
    it. Recorded at dispatch, 6 concurrent requests sharing a long system prompt are one cold, one hot-prefix
    warm-up, and four cache-affinity, over both engines."""
    rng = random.Random(4)
    system = "Shared rules: " + " ".join(sentence(rng, 12) for _ in range(20))
    with engines(tok, 2, delay_s=0.05) as (_fakes, ws), router(ws, hot_prefix_half_life_s=10.0) as url:

        def one(i: int) -> tuple[str, str]:
            body = {
                "model": MODEL,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"{i} question"}],
                "max_tokens": 8,
            }
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r.headers["x-radixserve-worker"], r.headers["x-radixserve-route-reason"]

        first = one(0)  # the group's first request: cold on the owner
        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            rest = list(ex.map(one, range(1, 7)))
    assert first[1] == "cold"
    reasons = Counter(r for _, r in rest)
    assert reasons == {"hot-prefix": 1, "cache-affinity": 5}, reasons
    assert {w for w, _ in rest} == set(ws)
