"""Verified cache state (router/cache_state.py): the router follows each engine's radix cache over the engine's
HTTP contract (GET /cache_snapshot, /cache_events, /load, POST /prefix_blocks; the real engine HTTP layer over
tests/fake_engine.py with a real CacheEventLog), checks block-hash parity, and routes on what an ``exact`` engine
holds. Unit rounds go over httpx's ASGI transport; the end-to-end tests serve engines and router with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.contracts import constants
from radixserve.engine.memory.cache_events import CacheEventLog
from radixserve.engine.server.http import create_app as engine_app
from radixserve.router.app import create_app
from radixserve.router.cache_state import (
    CACHE_STATES,
    CacheFollower,
    CacheStateTracker,
    DispatchRecord,
    EngineCacheView,
    attach,
    cacheable_tokens,
    canary_requests,
    prefix_match,
)
from radixserve.router.config import RouterArgs
from radixserve.router.metrics import RouterMetrics
from radixserve.router.policy import make_policy
from radixserve.router.prefix_key import PrefixKeyExtractor
from radixserve.router.types import Endpoint, WorkerLoad
from radixserve.router.workers import WorkerState

from fake_engine import FakeEngine, ServerThread, load_tokenizer, wait_until

MODEL = "smollm2-135m-instruct"
URL = "http://engine-0"
LOGGER = "radixserve.router.cache_state"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer()


class _Pool:
    """The WorkerPool surface the tracker reads: ``workers``, ``client``, ``args``."""

    def __init__(self, client: httpx.AsyncClient, urls: list[str]) -> None:
        self.client = client
        self.args = RouterArgs()
        self.workers = {u: WorkerState(url=u, endpoint=Endpoint(u), load=WorkerLoad(u), models=(MODEL,)) for u in urls}


def tracker_for(
    client: httpx.AsyncClient, tok: Any, block_tokens: int = 16, urls: tuple[str, ...] = (URL,), **kw: Any
) -> CacheStateTracker:
    extractor = PrefixKeyExtractor(block_tokens=block_tokens)
    if tok is not None:
        extractor.set_tokenizer(MODEL, tok)
    kw.setdefault("parity_interval_s", 0.0)
    return CacheStateTracker(_Pool(client, list(urls)), extractor, kw.pop("metrics", None), None, **kw)


async def poll(tracker: CacheStateTracker, url: str = URL) -> CacheFollower:
    f = tracker.followers.setdefault(url, CacheFollower(url))
    await tracker.poll(f, tracker.pool.workers[url])
    return f


def asgi_client(*fakes: FakeEngine) -> httpx.AsyncClient:
    """One client reaching fake engine i at http://engine-i through the real engine HTTP layer."""
    mounts = {
        f"http://engine-{i}": httpx.ASGITransport(app=engine_app(fake, manage_engine=False))
        for i, fake in enumerate(fakes)
    }
    return httpx.AsyncClient(mounts=mounts)


def warnings_of(caplog: Any, url: str = URL) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and r.getMessage().startswith(f"worker {url} ")
    ]


# ------------------------------------------------------------------------------------------------ pieces


def test_prefix_match_and_view_events():
    assert prefix_match({1, 2, 3}, [1, 2, 3, 4]) == 3
    assert prefix_match({2, 3}, [1, 2, 3]) == 0 and prefix_match(set(), []) == 0
    view = EngineCacheView()
    view.load_snapshot({"incarnation": "a", "model": MODEL, "block_tokens": 16, "seq": 2, "blocks": [5, 6]})
    body = {"incarnation": "a", "model": MODEL, "block_tokens": 16, "seq": 4, "gap": False}
    events = [{"seq": 3, "type": "stored", "blocks": [7]}, {"seq": 4, "type": "removed", "blocks": [5]}]
    assert view.apply_events({**body, "events": events}) is None
    assert view.blocks == {6, 7} and view.seq == 4
    assert view.apply_events({**body, "seq": 5, "events": [{"seq": 5, "type": "cleared", "blocks": []}]}) is None
    assert view.blocks == set() and view.seq == 5
    # Each reason to resync leaves the view as it was.
    assert view.apply_events({**body, "incarnation": "b", "seq": 0, "events": []}) == "incarnation"
    assert view.apply_events({**body, "seq": 9, "gap": True, "events": []}) == "gap"
    skipped = [{"seq": 7, "type": "stored", "blocks": [1]}]
    assert view.apply_events({**body, "seq": 7, "events": skipped}) == "seq"
    assert view.apply_events({**body, "seq": 7, "events": []}) == "seq"  # says seq 7, brings nothing
    assert view.blocks == set() and view.seq == 5
    with pytest.raises(ValueError):
        view.apply_events({**body, "seq": 6, "events": [{"seq": 6, "type": "bogus", "blocks": []}]})


def test_dispatch_record_expires_and_stays_prefix_closed():
    now = [0.0]
    rec = DispatchRecord(ttl_s=5.0, clock=lambda: now[0])
    rec.record("w", [1, 2, 3])
    now[0] = 3.0
    rec.record("w", [1, 2])  # the shared parents are refreshed
    assert rec.match("w", [1, 2, 3, 4]) == 3
    now[0] = 5.5  # blocks 1..3 of the first prompt expired, the refreshed parents not
    assert rec.match("w", [1, 2, 3]) == 2
    now[0] = 9.0
    assert rec.match("w", [1, 2, 3]) == 0 and rec.match("other", [1]) == 0


def test_canaries_span_several_blocks(tok):
    extractor = PrefixKeyExtractor(block_tokens=64)
    extractor.set_tokenizer(MODEL, tok)
    for endpoint, request in canary_requests(MODEL):
        key = extractor.extract(endpoint, request, MODEL)
        assert key is not None and len(key.blocks) >= 2, endpoint


# ------------------------------------------------------------------------------------------------ following events


class ModelCache:
    """The engine side of the property test: a tree of live blocks (each with its parent) published to the fake
    engine's CacheEventLog as a radix cache would, with a small ring so readers fall behind it."""

    def __init__(self, fake: FakeEngine, capacity: int) -> None:
        self.fake, self.capacity, self.next_id = fake, capacity, 1
        self.restart()

    def restart(self) -> None:
        self.log = CacheEventLog(MODEL, 16, capacity=self.capacity)
        self.fake.cache_events = self.log
        self.parent: dict[int, int | None] = {}

    def insert(self, at: int, n: int) -> None:
        live = sorted(self.parent)
        parent = live[at % len(live)] if live and at >= 0 else None
        chain = []
        for _ in range(n):
            h = (self.next_id * 0x9E3779B97F4A7C15) % 2**64
            self.next_id += 1
            self.parent[h] = parent
            chain.append(h)
            parent = h
        self.log.stored(chain)

    def evict(self, at: int, n: int) -> None:
        removed: list[int] = []
        for _ in range(n):
            parents = set(self.parent.values())
            leaves = sorted(b for b in self.parent if b not in parents)
            if not leaves:
                break
            leaf = leaves[at % len(leaves)]
            del self.parent[leaf]
            removed.append(leaf)
        self.log.removed(removed)

    def clear(self) -> None:
        self.parent.clear()
        self.log.cleared()


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(-1, 40), st.integers(1, 4)),
        st.tuples(st.just("evict"), st.integers(0, 40), st.integers(1, 3)),
        st.just(("clear",)),
        st.just(("restart",)),
        st.just(("poll",)),
        st.just(("poll",)),
    ),
    max_size=40,
)


@pytest.fixture(scope="module")
def served(tok: Any) -> tuple[FakeEngine, Any]:
    """One fake engine and its HTTP app for all the property test's examples (each brings its own event log)."""
    fake = FakeEngine(tok)
    return fake, engine_app(fake, manage_engine=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, capacity=st.integers(1, 6))
def test_view_equals_the_engines_set_after_every_poll(tok, served, ops, capacity):
    fake, app = served
    engine = ModelCache(fake, capacity)

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            tracker = tracker_for(client, tok)
            f = await poll(tracker)
            restarted = False
            for op in [*ops, ("poll",)]:
                if op[0] == "insert":
                    engine.insert(op[1], op[2])
                elif op[0] == "evict":
                    engine.evict(op[1], op[2])
                elif op[0] == "clear":
                    engine.clear()
                elif op[0] == "restart":
                    tracker.index.record(URL, [42])  # what the router predicted there is gone with the process
                    engine.restart()
                    restarted = True
                else:
                    f = await poll(tracker)
                    assert f.view.incarnation == engine.log.incarnation
                    assert f.view.blocks == set(engine.parent) == set(engine.log.snapshot().blocks)
                    assert f.view.seq == engine.log.seq
                    assert f.state == "exact", f.reason
                    if restarted:
                        assert tracker.index.size(URL) == 0
                        restarted = False
            assert f.resyncs >= 1  # the start's, and one per gap or restart seen

    asyncio.run(run())


def test_a_restart_forgets_at_once_and_load_is_read(tok):
    fake = FakeEngine(tok)
    fake.cache_events = CacheEventLog(MODEL, 16, capacity=1)
    fake.load.update(queued_prefill_tokens=300, running_tokens=700, queued_requests=1, running_requests=2)

    async def run() -> None:
        async with asgi_client(fake) as client:
            metrics = RouterMetrics()
            tracker = tracker_for(client, tok, metrics=metrics)
            assert fake.cache_events is not None
            fake.cache_events.stored([11, 12, 13])
            f = await poll(tracker)
            assert f.state == "exact" and f.view.blocks == {11, 12, 13}
            assert tracker.pool.workers[URL].load.engine_tokens == 1000
            assert tracker.pool.workers[URL].load.engine_requests == 3
            assert tracker.match(URL, [11, 12, 13, 14]) == 3
            tracker.record(URL, [11, 12, 13, 14])
            tracker.index.record(URL, [11, 12, 13, 14])
            assert tracker.match(URL, [11, 12, 13, 14]) == 4  # dispatched, not confirmed yet
            fake.cache_events.stored([14])
            fake.cache_events.stored([15])  # the one-event ring dropped the first: a gap
            f = await poll(tracker)
            assert f.view.blocks == {11, 12, 13, 14, 15} and f.view.seq == fake.cache_events.seq
            fake.cache_events = CacheEventLog(MODEL, 16)  # a new process at the same URL
            f = await poll(tracker)
            assert f.view.blocks == set() and f.view.incarnation == fake.cache_events.incarnation
            assert tracker.match(URL, [11, 12, 13, 14]) == 0 and tracker.index.size(URL) == 0
            assert f.state == "exact"
            samples = {
                s.labels["reason"]: s.value
                for s in metrics.cache_resyncs.collect()[0].samples
                if s.name.endswith("_total")
            }
            assert samples == {"start": 1.0, "gap": 1.0, "incarnation": 1.0}

    asyncio.run(run())


# ------------------------------------------------------------------------------------------------ parity


def test_parity_catches_another_block_size(tok, caplog):
    fake = FakeEngine(tok)

    async def run() -> CacheFollower:
        async with asgi_client(fake) as client:
            tracker = tracker_for(client, tok, block_tokens=32)
            f = await poll(tracker)
            assert tracker.state(URL) == "degraded"
            tracker.index.record(URL, [1, 2])
            assert tracker.match(URL, [1, 2, 3]) == 2  # the router's own prediction
            # The probe itself sees it too.
            why = await tracker.check_parity(client, URL, MODEL)
            assert why is not None and "16 tokens" in why and "--block-tokens 32" in why
            return f

    with caplog.at_level(logging.INFO, logger=LOGGER):
        f = asyncio.run(run())
    assert f.state == "degraded" and "--block-tokens 32" in f.reason, f.reason
    (line,) = warnings_of(caplog)
    assert line.startswith(f"worker {URL} cache state degraded (was unknown): the engine's blocks are 16 tokens")


def test_parity_catches_another_chat_template(tok, caplog):
    other = load_tokenizer()
    other.chat_template = tok.chat_template.replace("message['role'] + '\n'", "message['role'] + ':\n'")
    assert other.chat_template != tok.chat_template
    fake = FakeEngine(other)  # the engine renders chats with another template than the router's tokenizer

    async def run() -> CacheFollower:
        async with asgi_client(fake) as client:
            tracker = tracker_for(client, tok)
            return await poll(tracker)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        f = asyncio.run(run())
    assert f.state == "degraded" and "parity failed" in f.reason and "chat canary" in f.reason, f.reason
    (line,) = warnings_of(caplog)
    assert "cache state degraded (was unknown): parity failed" in line and "chat template" in line


def test_an_engine_without_events_is_degraded_and_still_predicted(tok, caplog):
    fake = FakeEngine(tok, cache_event_block_tokens=0)
    assert fake.cache_events is None

    async def run() -> CacheFollower:
        async with asgi_client(fake) as client:
            tracker = tracker_for(client, tok)
            f = await poll(tracker)
            tracker.index.record(URL, [1, 2, 3])
            assert tracker.match(URL, [1, 2, 3]) == 3
            assert tracker.pool.workers[URL].load.engine_tokens == 0  # /load still answers
            return f

    with caplog.at_level(logging.INFO, logger=LOGGER):
        f = asyncio.run(run())
    assert f.state == "degraded" and "404 from GET /cache_snapshot" in f.reason, f.reason
    assert len(warnings_of(caplog)) == 1


def test_an_older_engine_is_asked_again_only_now_and_then(tok):
    """An engine without any of the routes (404 everywhere) gets one try per path per parity interval, not one per
    poll: an older engine logs every request it answers."""
    asked: list[str] = []
    now = [0.0]

    def older(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(404, json={"detail": "Not Found"})

    async def run() -> CacheFollower:
        async with httpx.AsyncClient(transport=httpx.MockTransport(older)) as client:
            tracker = tracker_for(client, tok, parity_interval_s=60.0, clock=lambda: now[0])
            for t in (0.0, 0.5, 1.0, 59.0):
                now[0] = t
                f = await poll(tracker)
            assert asked == ["/cache_snapshot", "/load"]
            now[0] = 61.0
            f = await poll(tracker)
            assert asked == ["/cache_snapshot", "/load"] * 2
            tracker.index.record(URL, [3])
            assert tracker.match(URL, [3]) == 1
            return f

    f = asyncio.run(run())
    assert f.state == "degraded" and f.engine_tokens is None


def test_an_unreachable_engine_becomes_unknown_then_exact_again(tok, caplog):
    fake = FakeEngine(tok)
    down = [False]
    inner = httpx.ASGITransport(app=engine_app(fake, manage_engine=False))

    class Flaky(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if down[0]:
                raise httpx.ConnectError("refused", request=request)
            return await inner.handle_async_request(request)

    async def run() -> None:
        async with httpx.AsyncClient(transport=Flaky()) as client:
            tracker = tracker_for(client, tok)
            assert fake.cache_events is not None
            fake.cache_events.stored([5])
            assert (await poll(tracker)).state == "exact"
            down[0] = True
            assert (await poll(tracker)).state == "exact"  # one lost poll keeps the view
            f = await poll(tracker)
            assert f.state == "unknown" and "does not answer" in f.reason, f.reason
            tracker.index.record(URL, [9])
            assert tracker.match(URL, [9]) == 1 and tracker.match(URL, [5]) == 0  # predicted while unknown
            assert tracker.pool.workers[URL].load.engine_tokens is None
            down[0] = False
            fake.cache_events.stored([6])
            f = await poll(tracker)
            assert f.state == "exact" and f.view.blocks == {5, 6} and f.resyncs == 1  # followed on, no resync

    with caplog.at_level(logging.INFO, logger=LOGGER):
        asyncio.run(run())
    assert warnings_of(caplog) == [
        f"worker {URL} cache state unknown (was exact): the engine does not answer (ConnectError: refused on GET "
        "/cache_events)"
    ]


# ------------------------------------------------------------------------------------------------ routing


def _key(tok: Any, text: str) -> Any:
    extractor = PrefixKeyExtractor(block_tokens=16)
    extractor.set_tokenizer(MODEL, tok)
    return extractor.extract("completions", {"model": MODEL, "prompt": text}, MODEL)


def test_the_policy_matches_through_the_oracle(tok):
    fakes = [FakeEngine(tok), FakeEngine(tok)]
    urls = ("http://engine-0", "http://engine-1")
    key = _key(tok, "A long shared document about radix trees and prefix caches. " * 12)
    assert key is not None and len(key.blocks) >= 8

    async def run() -> None:
        async with asgi_client(*fakes) as client:
            policy = make_policy("prefix_hash", hot_prefix_half_life_s=0.0)
            tracker = tracker_for(client, tok, urls=urls)
            assert attach(policy, tracker) and tracker.index is policy.index  # type: ignore[attr-defined]
            policy.set_workers(list(urls))
            holder = urls[1]
            assert fakes[1].cache_events is not None
            fakes[1].cache_events.stored(key.blocks)  # the engine holds it; this router never sent it there
            for u in urls:
                await poll(tracker, u)
            assert tracker.state(urls[0]) == tracker.state(holder) == "exact"
            predicted = policy.predicted_cached_tokens(holder, key)  # type: ignore[attr-defined]
            assert predicted == len(key.blocks) * 16
            assert policy.predicted_cached_tokens(urls[0], key) == 0  # type: ignore[attr-defined]
            assert cacheable_tokens(policy, key, urls) == predicted
            loads = [WorkerLoad(u) for u in urls]
            first = policy.rank(key, loads, key.prompt_tokens)[0]
            assert (first.worker, first.reason, first.predicted_cached_tokens) == (
                holder,
                "cache-affinity",
                predicted,
            )
            # A burst: the first request of a cold prompt is dispatched; the next ones follow it at once.
            cold = _key(tok, "Another prompt nobody has seen, long enough for many blocks of tokens. " * 10)
            assert cacheable_tokens(policy, cold, urls) == 0
            policy.record(urls[0], cold)
            assert tracker.match(urls[0], cold.blocks) == len(cold.blocks)
            assert cacheable_tokens(policy, cold, urls) > 0
            # The same on a degraded worker comes from the policy's index (what it was sent).
            tracker.followers[urls[0]].state = "degraded"
            assert tracker.match(urls[0], cold.blocks) == len(cold.blocks)
            assert tracker.match(urls[0], key.blocks) == 0

    asyncio.run(run())


def test_no_oracle_when_the_events_are_off():
    policy = make_policy("least_load")
    tracker = CacheStateTracker(None, PrefixKeyExtractor(), None, None, interval_s=0.0)
    assert not attach(policy, tracker) and policy.oracle is None  # type: ignore[attr-defined]
    assert tracker.describe("http://x")["cache_state"] == "degraded"


# ------------------------------------------------------------------------------------------------ over HTTP


@contextlib.contextmanager
def stack(fakes: list[FakeEngine], **kw: Any) -> Iterator[tuple[str, list[str], Any]]:
    """Engines (the real engine HTTP layer over ``fakes``) and a router in front of them, all on uvicorn:
    (router url, engine urls, router app)."""
    kw.setdefault("health_interval_s", 0.5)
    kw.setdefault("cache_events_interval_s", 0.1)
    with contextlib.ExitStack() as es:
        urls = [es.enter_context(ServerThread(engine_app(f, manage_engine=False))) for f in fakes]
        app = create_app(RouterArgs(worker_urls=urls, **kw))
        url = es.enter_context(ServerThread(app))
        assert wait_until(lambda: httpx.get(url + "/health").json()["routable_workers"] == len(urls), 30)
        yield url, urls, app


def worker_health(url: str) -> dict[str, dict[str, Any]]:
    return {w["url"]: w for w in httpx.get(url + "/health").json()["workers"]}


def gauge(url: str, worker: str, state: str) -> float | None:
    want = f'{constants.ROUTER_METRIC_PREFIX}worker_cache_state{{state="{state}",worker="{worker}"}} '
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(want):
            return float(line.rsplit(" ", 1)[1])
    return None


def counter(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(constants.ROUTER_METRIC_PREFIX + name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_router_routes_on_the_engines_reported_cache(tok):
    fakes = [FakeEngine(tok), FakeEngine(tok)]
    fakes[0].load.update(running_tokens=1234)
    with stack(fakes) as (url, urls, app):
        assert wait_until(lambda: all(w["cache_state"] == "exact" for w in worker_health(url).values()), 30)
        health = worker_health(url)
        assert health[urls[0]]["cache_state_reason"] == "following the engine's cache events; parity ok"
        assert health[urls[0]]["engine_tokens"] == 1234 and health[urls[1]]["engine_tokens"] == 0
        assert [gauge(url, urls[0], s) for s in CACHE_STATES] == [1.0, 0.0, 0.0]

        # Engine 1 holds the prompt (as it hashes it); this router never sent it there.
        request = {"model": MODEL, "prompt": "Radix trees share prefixes between prompts. " * 30, "max_tokens": 2}
        r = httpx.post(urls[1] + "/prefix_blocks", json={"endpoint": "completions", "request": request})
        blocks, prompt_tokens = r.json()["blocks"], r.json()["prompt_tokens"]
        assert fakes[1].cache_events is not None and len(blocks) >= 8
        fakes[1].cache_events.stored(blocks)
        tracker = app.state.cache_state
        assert wait_until(lambda: set(blocks) <= tracker.followers[urls[1]].view.blocks, 10)
        r = httpx.post(url + "/v1/completions", json=request)
        assert r.status_code == 200, r.text
        held = min(len(blocks) * 16, prompt_tokens - 1)
        assert counter(url, "cacheable_tokens_total") == held
        assert r.headers[constants.HEADER_WORKER] == urls[1]
        assert r.headers[constants.HEADER_ROUTE_REASON] == "cache-affinity"
        assert counter(url, "predicted_cached_tokens_total") == held

        # Engine 1 restarts: a new incarnation, nothing cached; the router forgets at its next poll.
        fakes[1].cache_events = CacheEventLog(MODEL, 16)
        new = fakes[1].cache_events.incarnation
        assert wait_until(lambda: tracker.followers[urls[1]].view.incarnation == new, 10)
        assert tracker.match(urls[1], blocks) == 0 and app.state.policy.index.size(urls[1]) == 0


def test_router_health_shows_degraded_engines_and_still_routes(tok, caplog):
    fakes = [FakeEngine(tok, cache_event_block_tokens=0)]
    with caplog.at_level(logging.INFO, logger=LOGGER), stack(fakes, block_tokens=32) as (url, urls, _app):
        assert wait_until(lambda: worker_health(url)[urls[0]]["cache_state"] == "degraded", 30)
        assert "404" in worker_health(url)[urls[0]]["cache_state_reason"]
        assert gauge(url, urls[0], "degraded") == 1.0 and gauge(url, urls[0], "exact") == 0.0
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hello " * 40, "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert [m for m in warnings_of(caplog, urls[0]) if "cache state degraded" in m]


def test_router_with_another_block_size_is_degraded(tok, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER), stack([FakeEngine(tok)], block_tokens=32) as (url, urls, _):
        assert wait_until(lambda: worker_health(url)[urls[0]]["cache_state"] == "degraded", 30)
        reason = worker_health(url)[urls[0]]["cache_state_reason"]
        assert "16 tokens" in reason and "--block-tokens 32" in reason
    assert len([m for m in warnings_of(caplog, urls[0]) if "cache state degraded" in m]) == 1


def test_cache_events_off():
    args = RouterArgs(worker_urls=["http://127.0.0.1:9"], cache_events_interval_s=0)
    app = create_app(args)
    assert app.state.policy.oracle is None
    with pytest.raises(ValueError, match="--cache-events-interval-s must be >= 0"):
        create_app(RouterArgs(worker_urls=["http://127.0.0.1:9"], cache_events_interval_s=-1))


def test_docs_list_the_cache_states_and_metrics():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "contracts.md").read_text(encoding="utf-8")
    assert CACHE_STATES == constants.ROUTER_CACHE_STATES
    assert '`"cache_state"`' in doc and " | ".join(f"`{s}`" for s in CACHE_STATES) in doc
    for name in ("worker_cache_state", "cacheable_tokens_total", "cache_resyncs_total", "--cache-events-interval-s"):
        assert name in doc
