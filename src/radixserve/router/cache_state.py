"""Verified cache state: each engine's radix cache as it reports it, and whether the router may trust that report.

Engines publish their radix cache as block events in the router's own block-hash scheme (``contracts/block_hash.py``;
``GET /cache_snapshot``, ``GET /cache_events?since=SEQ``, ``POST /prefix_blocks``, ``GET /load``, docs/contracts.md).
Per worker, a ``CacheFollower`` polls them every ``--cache-events-interval-s`` (0.5 s; one GET of the events and one of
the load, a few hundred bytes when nothing changed) into an ``EngineCacheView``, the engine's live block-hash set. It
resyncs from the snapshot at start, on a ``gap`` (the engine's ring dropped events the router had not read), on a new
``incarnation`` (the engine restarted: its old blocks are forgotten at once, those the router's ``PrefixIndex``
predicted there too) and on a seq it did not expect. The load (queued prefill + running KV tokens) goes to
``WorkerLoad.engine_tokens``.

A parity probe checks the view means what the router's keys mean: at admission and every
``--cache-parity-interval-s`` (60 s) the router keys two canary requests (a chat with a system and a user message, a
plain completion) with its own ``PrefixKeyExtractor`` and asks the engine for the same requests' blocks
(``POST /prefix_blocks``). Equal block sizes, prompt lengths and hashes: parity ok. A worker's cache state is:

- ``exact``: the view follows the engine's events and parity holds: matches come from what the engine holds;
- ``degraded``: the engine lacks the endpoints (an older engine, events off: 404), or parity failed (another
  ``--block-tokens``, chat template or tokenizer): matches are the router's own prediction (``PrefixIndex``);
- ``unknown``: not synced yet, parity not checked yet, or the engine does not answer (two polls in a row):
  predicted too.

Every change is one log line with its reason (a WARNING, but INFO for becoming ``exact``: good news, as the pool's
recovery lines) and the gauge ``radixserve_router_worker_cache_state{worker,state}``; ``/health`` shows each worker's
``cache_state`` and ``cache_state_reason``.

``CacheStateTracker`` is the policies' ``CacheOracle`` (``types.py``; ``IndexedPolicy.oracle``): for an ``exact``
worker a match is the longer of the engine-reported one and the one in what this router dispatched to it in the last
``DISPATCH_TTL_S`` seconds (``DispatchRecord``: a burst sharing a cold prefix follows its first request while that one
is still prefilling, before the engine's events say so); for any other worker the ``PrefixIndex`` prediction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import httpx

from radixserve.contracts import constants
from radixserve.contracts.block_hash import (
    ENGINE_CACHE_EVENTS_PATH,
    ENGINE_CACHE_SNAPSHOT_PATH,
    ENGINE_LOAD_PATH,
    ENGINE_PREFIX_BLOCKS_PATH,
)
from radixserve.router.breaker import failure_reason, status_reason
from radixserve.router.policy.simple import IndexedPolicy
from radixserve.router.prefix_index import PrefixIndex, prefix_match
from radixserve.router.types import PrefixKey, RoutingPolicy

if TYPE_CHECKING:  # pragma: no cover
    from radixserve.router.metrics import RouterMetrics
    from radixserve.router.workers import WorkerState

logger = logging.getLogger("radixserve.router.cache_state")

CacheState = Literal["exact", "degraded", "unknown"]
CACHE_STATES: tuple[CacheState, ...] = constants.ROUTER_CACHE_STATES  # type: ignore[assignment]
ResyncReason = Literal["start", "gap", "incarnation", "seq"]
RESYNC_REASONS: tuple[ResyncReason, ...] = ("start", "gap", "incarnation", "seq")

# Seconds a dispatched prompt counts as held by an exact worker before its events confirm it: longer than a prefill
# plus a poll. Past it, only the engine's own report counts.
DISPATCH_TTL_S = 10.0
# Consecutive failed polls after which a worker's cache state is unknown (one lost poll keeps the last view).
UNREACHABLE_AFTER_POLLS = 2
POLL_TIMEOUT_S = 2.0  # per cache-state request (the probes have their own)

# The parity canaries: fixed requests of several blocks at any usual --block-tokens, with accents, CJK and an emoji
# so another vocabulary tokenizes them differently.
_CANARY_SYSTEM = (
    "You are the parity canary of a radixserve router. This fixed conversation checks that the router renders and "
    "tokenizes prompts exactly as this engine does: the same chat template, the same tokenizer, the same block size. "
    "Nothing here is ever generated from; only the prompt's token blocks are compared."
)
_CANARY_USER = (
    "Count the blocks with me: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, thirteen. "
    "Ünïcödé café, naïve façade, 日本語のテキスト, emoji 🙂🚀 and digits 3.14159 26535 89793 tokenize differently "
    "under other vocabularies, so a mismatch shows in the first blocks already."
)
_CANARY_PROMPT = (
    "radixserve parity canary. The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "
    "Sphinx of black quartz, judge my vow. Ünïcödé café, 日本語, 🙂. 0123456789 " * 3
)


def canary_requests(model: str) -> list[tuple[Literal["chat", "completions"], dict[str, Any]]]:
    """The parity probe's requests for ``model``: ``(endpoint, request body)``."""
    return [
        (
            "chat",
            {
                "model": model,
                "messages": [{"role": "system", "content": _CANARY_SYSTEM}, {"role": "user", "content": _CANARY_USER}],
                "max_tokens": 1,
            },
        ),
        ("completions", {"model": model, "prompt": _CANARY_PROMPT, "max_tokens": 1}),
    ]


class EngineCacheView:
    """One engine's live block hashes as its events say: ``incarnation``, ``seq`` (the last event applied),
    ``block_tokens`` and ``model`` (from its answers), ``blocks``. ``synced`` once a snapshot was loaded."""

    def __init__(self) -> None:
        self.incarnation: str | None = None
        self.seq = 0
        self.block_tokens: int | None = None
        self.model: str | None = None
        self.blocks: set[int] = set()
        self.synced = False

    def reset(self) -> None:
        """Forget everything (the engine restarted, or left)."""
        self.incarnation, self.seq, self.block_tokens, self.model = None, 0, None, None
        self.blocks = set()
        self.synced = False

    def load_snapshot(self, body: Mapping[str, Any]) -> None:
        """Replace the view with a ``GET /cache_snapshot`` answer. Raises ValueError / KeyError / TypeError for a
        body that is not one."""
        blocks = body["blocks"]
        if not isinstance(blocks, list):
            raise TypeError("blocks is not a list")
        self.incarnation = _str(body, "incarnation")
        self.seq = _int(body, "seq")
        self.block_tokens = _int(body, "block_tokens")
        self.model = _str(body, "model")
        self.blocks = {int(h) for h in blocks}
        self.synced = True

    def apply_events(self, body: Mapping[str, Any]) -> ResyncReason | None:
        """Apply a ``GET /cache_events?since=self.seq`` answer; the reason to take a snapshot instead (the view is
        left as it was), or None. Raises ValueError / KeyError / TypeError for a body that is not one."""
        if _str(body, "incarnation") != self.incarnation:
            return "incarnation"
        if body["gap"] is not False:
            return "gap"
        latest = _int(body, "seq")
        events = body["events"]
        if not isinstance(events, list):
            raise TypeError("events is not a list")
        expect = self.seq + 1
        for ev in events:  # all or nothing: check the run of seqs first
            if not isinstance(ev, dict) or ev.get("seq") != expect:
                return "seq"
            expect += 1
        if expect - 1 != latest:
            return "seq"
        for ev in events:
            kind = ev["type"]
            if kind == "stored":
                self.blocks.update(int(h) for h in ev["blocks"])
            elif kind == "removed":
                self.blocks.difference_update(int(h) for h in ev["blocks"])
            elif kind == "cleared":
                self.blocks.clear()
            else:
                raise ValueError(f"unknown event type {kind!r}")
        self.seq = latest
        self.block_tokens = _int(body, "block_tokens")
        self.model = _str(body, "model")
        return None

    def match(self, blocks: Sequence[int]) -> int:
        """Leading blocks of ``blocks`` the engine holds."""
        return prefix_match(self.blocks, blocks)


def _str(body: Mapping[str, Any], name: str) -> str:
    v = body[name]
    if not isinstance(v, str):
        raise TypeError(f"{name} is not a string")
    return v


def _int(body: Mapping[str, Any], name: str) -> int:
    v = body[name]
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{name} is not an integer")
    return v


class DispatchRecord:
    """Per worker, the block hashes of the prompts this router dispatched to it in the last ``ttl_s`` seconds (at
    most ``capacity_blocks`` per worker). A prompt's blocks are touched deepest first, so parents expire no earlier
    than their children and each worker's set stays prefix-closed (``prefix_match`` applies)."""

    def __init__(
        self, ttl_s: float = DISPATCH_TTL_S, capacity_blocks: int = 65536, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity_blocks
        self.clock = clock
        self._blocks: dict[str, OrderedDict[int, float]] = {}

    def record(self, worker: str, blocks: Sequence[int]) -> None:
        """``blocks`` (a prompt's chained hashes) were sent to ``worker`` now."""
        now = self.clock()
        held = self._blocks.setdefault(worker, OrderedDict())
        until = now + self.ttl_s
        for h in reversed(blocks):
            held[h] = until
            held.move_to_end(h)
        self._expire(held, now)
        while len(held) > self.capacity:
            held.popitem(last=False)

    @staticmethod
    def _expire(held: OrderedDict[int, float], now: float) -> None:
        while held:
            h, until = next(iter(held.items()))
            if until > now:
                return
            del held[h]

    def match(self, worker: str, blocks: Sequence[int]) -> int:
        """Leading blocks of ``blocks`` dispatched to ``worker`` within the TTL."""
        held = self._blocks.get(worker)
        if not held:
            return 0
        self._expire(held, self.clock())
        return prefix_match(held, blocks)

    def forget(self, worker: str) -> None:
        self._blocks.pop(worker, None)


class _NotServed(Exception):
    """The engine answered 404: it lacks the endpoint (an older engine, or events off)."""


class _BadStatus(Exception):
    """The engine answered another status than 200 or 404 (e.g. 401 without its key, 503 while it starts)."""


class _NoAnswer(Exception):
    """The parity probe got no answer (a transport error or a 5xx): keep the last result, try again next round."""


@dataclass
class CacheFollower:
    """One worker's cache state: its ``view``, the latest ``/load``, the parity result and the derived ``state``."""

    url: str
    view: EngineCacheView = field(default_factory=EngineCacheView)
    state: CacheState = "unknown"
    reason: str = "not synced yet"
    failures: int = 0  # consecutive failed polls
    last_error: str | None = None
    no_events: str | None = None  # why the engine publishes no events (a 404), if so
    events_retry_at: float = 0.0  # ...and when to ask again (monotonic seconds)
    no_load: bool = False  # the engine has no GET /load (404)
    load_retry_at: float = 0.0
    engine_tokens: int | None = None  # queued_prefill_tokens + running_tokens of the latest /load
    parity: str | None = None  # None: ok; else why it failed
    parity_checked: tuple[str, str, int] | None = None  # (incarnation, model, router block_tokens) it was checked for
    parity_at: float = 0.0  # monotonic seconds of the last parity check
    resyncs: int = 0
    resync_reason: ResyncReason = "start"  # why the next snapshot is taken while the view is not synced

    def describe(self) -> dict[str, Any]:
        return {"cache_state": self.state, "cache_state_reason": self.reason, "engine_tokens": self.engine_tokens}


class CacheStateTracker:
    """Follows every worker of ``pool`` (``WorkerPool``: its ``workers``, ``client``) and is the policies'
    ``CacheOracle``. ``extractor``: the router's ``PrefixKeyExtractor`` (parity); ``index``: the policy's
    ``PrefixIndex`` (predictions for workers that are not ``exact``); ``interval_s``: seconds between polls of a
    worker (0: the tracker never polls and every worker is ``degraded``); ``parity_interval_s``: seconds between
    parity checks of a worker (0: at admission and on a new incarnation only). ``engine_api_key``: sent as a bearer
    key. Runs on the router's event loop; no locks."""

    def __init__(
        self,
        pool: Any,
        extractor: Any,
        metrics: RouterMetrics | None,
        index: PrefixIndex | None,
        interval_s: float = 0.5,
        parity_interval_s: float = 60.0,
        engine_api_key: str | None = None,
        dispatch_ttl_s: float = DISPATCH_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.extractor = extractor
        self.metrics = metrics
        self.index = index if index is not None else PrefixIndex()
        self.interval_s = interval_s
        self.parity_interval_s = parity_interval_s
        self.clock = clock
        self.dispatched = DispatchRecord(dispatch_ttl_s, self.index.capacity, clock)
        self._headers = {"authorization": f"Bearer {engine_api_key}"} if engine_api_key else {}
        self.followers: dict[str, CacheFollower] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._supervisor: asyncio.Task[None] | None = None
        self._gauges: dict[str, dict[CacheState, Any]] = {}

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0

    # ------------------------------------------------------------------------------------------------ oracle
    def match(self, worker: str, blocks: Sequence[int]) -> int:
        """Leading blocks of ``blocks`` ``worker`` holds: engine-reported (or dispatched within the TTL) for an
        ``exact`` worker, else the ``PrefixIndex`` prediction."""
        f = self.followers.get(worker)
        if f is None or f.state != "exact":
            return self.index.match(worker, blocks)
        return max(f.view.match(blocks), self.dispatched.match(worker, blocks))

    def record(self, worker: str, blocks: Sequence[int]) -> None:
        """A prompt of ``blocks`` was dispatched to ``worker`` (the policy records it in its index itself)."""
        if self.enabled:
            self.dispatched.record(worker, blocks)

    def state(self, worker: str) -> CacheState:
        f = self.followers.get(worker)
        if f is not None:
            return f.state
        return "unknown" if self.enabled else "degraded"

    def describe(self, worker: str) -> dict[str, Any]:
        """``/health``'s cache fields of ``worker``: ``cache_state``, ``cache_state_reason`` and ``engine_tokens``
        (the engine's last load report, queued prefill + running KV tokens; null without one)."""
        f = self.followers.get(worker)
        if f is not None:
            return f.describe()
        if not self.enabled:
            why = "cache events off (--cache-events-interval-s 0)"
            return {"cache_state": "degraded", "cache_state_reason": why, "engine_tokens": None}
        return {"cache_state": "unknown", "cache_state_reason": "not synced yet", "engine_tokens": None}

    # ------------------------------------------------------------------------------------------------ tasks
    async def start(self) -> None:
        """Start following the pool's workers (idempotent; nothing when ``interval_s`` is 0)."""
        if self.enabled and self._supervisor is None:
            self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def stop(self) -> None:
        tasks = [t for t in [self._supervisor, *self._tasks.values()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._supervisor = None
        self._tasks.clear()

    async def _supervise(self) -> None:
        """One following task per worker of the pool; a removed worker's state is forgotten."""
        while True:
            workers: Mapping[str, WorkerState] = self.pool.workers
            for url in workers:
                if url not in self._tasks:
                    self._tasks[url] = asyncio.get_running_loop().create_task(self._follow(url))
            for url in [u for u in self._tasks if u not in workers]:
                self._tasks.pop(url).cancel()
                self.forget(url)
            await asyncio.sleep(self.interval_s)

    def forget(self, url: str) -> None:
        """``url`` left the pool: drop its view, its dispatch record and its gauges."""
        self.followers.pop(url, None)
        self.dispatched.forget(url)
        gauges = self._gauges.pop(url, None)
        if gauges is not None and self.metrics is not None:
            for state in gauges:
                with contextlib.suppress(KeyError):
                    self.metrics.worker_cache_state.remove(url, state)

    async def _follow(self, url: str) -> None:
        f = self.followers.setdefault(url, CacheFollower(url))
        self._publish(f)
        while True:
            w = self.pool.workers.get(url)
            if w is None:
                return
            if w.models:  # admitted once: its models (and their tokenizers) are known
                try:
                    await self.poll(f, w)
                except Exception:  # a bug must not end this worker's following for good
                    logger.exception("worker %s: cache state round failed", url)
            routable = w.breaker.routable or not w.models  # a pending worker: check soon, no request is sent
            await asyncio.sleep(self.interval_s if routable else max(self.interval_s, self.pool.args.health_interval_s))

    @property
    def _retry_missing_s(self) -> float:
        """Seconds before asking again for an endpoint the engine answered 404 (an older engine would log every
        request of a 0.5 s poll): the parity interval, 60 s when that is 0."""
        return max(self.interval_s, self.parity_interval_s or 60.0)

    # ------------------------------------------------------------------------------------------------ one round
    async def poll(self, f: CacheFollower, w: WorkerState) -> None:
        """One round for worker ``w``: events (or a snapshot), the load, parity when due; then its state."""
        client: httpx.AsyncClient = self.pool.client
        now = self.clock()
        try:
            if f.no_events is None or now >= f.events_retry_at:
                try:
                    await self._sync(f, client)
                    f.no_events = None
                except _NotServed as e:
                    if f.no_events is None and f.view.synced:
                        logger.info("worker %s stopped publishing cache events: its view is dropped", f.url)
                    f.view.reset()
                    f.no_events, f.events_retry_at = str(e), now + self._retry_missing_s
            if not f.no_load or now >= f.load_retry_at:
                await self._load(f, w, client, now)
            f.failures, f.last_error = 0, None
        except httpx.HTTPError as e:
            f.failures += 1
            f.last_error = f"{failure_reason(e)} on GET {_path(e)}"
        except _BadStatus as e:
            f.failures += 1
            f.last_error = str(e)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            f.failures += 1
            f.last_error = f"not a cache-events answer ({type(e).__name__}: {e})"
            f.view.synced = False  # start over from a snapshot
        if f.failures >= UNREACHABLE_AFTER_POLLS:
            f.engine_tokens = w.load.engine_tokens = w.load.engine_requests = None
        if f.no_events is None and f.failures == 0 and f.view.synced:
            await self._parity_if_due(f, w, client)
        self._evaluate(f, w)

    async def _get(self, client: httpx.AsyncClient, url: str, params: dict[str, Any] | None = None) -> Any:
        r = await client.get(url, params=params, headers=self._headers, timeout=POLL_TIMEOUT_S)
        path = httpx.URL(url).path
        if r.status_code == 404:
            raise _NotServed(
                f"the engine publishes no cache events (404 from GET {path}: an older engine, or "
                "--cache-event-block-tokens 0)"
            )
        if r.status_code != 200:
            raise _BadStatus(status_reason(r.status_code, "GET", path))
        return r.json()

    async def _sync(self, f: CacheFollower, client: httpx.AsyncClient) -> None:
        view = f.view
        reason: ResyncReason | None = f.resync_reason
        if view.synced:
            body = await self._get(client, f.url + ENGINE_CACHE_EVENTS_PATH, {"since": view.seq})
            reason = view.apply_events(body)
            if reason is None:
                return
        old = view.incarnation
        body = await self._get(client, f.url + ENGINE_CACHE_SNAPSHOT_PATH)
        new = _str(body, "incarnation")
        if old is not None and new != old:
            self._restarted(f, old, new)
        view.load_snapshot(body)
        f.resyncs, f.resync_reason = f.resyncs + 1, "start"
        if self.metrics is not None:
            self.metrics.cache_resyncs.labels(reason).inc()
        logger.debug(
            "worker %s cache view resynced (%s): %d blocks at seq %d", f.url, reason, len(view.blocks), view.seq
        )

    def _restarted(self, f: CacheFollower, old: str, new: str) -> None:
        """The engine at ``f.url`` is a new process: everything it held, and everything predicted there, is gone."""
        logger.info(
            "worker %s restarted (cache incarnation %s -> %s): its cached blocks are forgotten", f.url, old, new
        )
        f.view.reset()
        f.parity, f.parity_checked, f.resync_reason = None, None, "incarnation"
        self.dispatched.forget(f.url)
        self.index.forget(f.url)

    async def _load(self, f: CacheFollower, w: WorkerState, client: httpx.AsyncClient, now: float) -> None:
        """``GET /load`` into ``w.load.engine_tokens`` (None, asked again later, when the engine has no /load). A
        new incarnation there forgets the view at once. Raises what ``_get`` raises, ValueError and the like."""
        try:
            body = await self._get(client, f.url + ENGINE_LOAD_PATH)
        except _NotServed:
            f.engine_tokens = w.load.engine_tokens = w.load.engine_requests = None
            f.no_load, f.load_retry_at = True, now + self._retry_missing_s
            return
        except Exception:
            f.engine_tokens = w.load.engine_tokens = w.load.engine_requests = None
            raise
        f.no_load = False
        tokens = _int(body, "queued_prefill_tokens") + _int(body, "running_tokens")
        f.engine_tokens = w.load.engine_tokens = tokens
        w.load.engine_requests = _int(body, "queued_requests") + _int(body, "running_requests")
        inc = body.get("incarnation")
        if isinstance(inc, str) and f.view.incarnation is not None and inc != f.view.incarnation:
            self._restarted(f, f.view.incarnation, inc)  # the next round loads its snapshot

    # ------------------------------------------------------------------------------------------------ parity
    async def _parity_if_due(self, f: CacheFollower, w: WorkerState, client: httpx.AsyncClient) -> None:
        model = w.models[0]
        if not self.extractor.has_tokenizer(model):
            return  # degraded without asking (see _derive); checked again once a tokenizer is there
        assert f.view.incarnation is not None
        checked_for = (f.view.incarnation, model, int(self.extractor.block_tokens))
        now = self.clock()
        stale = self.parity_interval_s > 0 and now - f.parity_at >= self.parity_interval_s
        if f.parity_checked == checked_for and not stale:
            return
        try:
            result = await self.check_parity(client, f.url, model)
        except _NoAnswer:
            return
        f.parity, f.parity_checked, f.parity_at = result, checked_for, now

    async def check_parity(self, client: httpx.AsyncClient, url: str, model: str) -> str | None:
        """Key the canaries with the router's extractor and ask the engine at ``url`` for theirs: None (parity ok)
        or the reason it failed. Raises ``_NoAnswer`` (no answer, or a 5xx: try again later)."""
        for endpoint, request in canary_requests(model):
            key: PrefixKey | None = self.extractor.extract(endpoint, request, model)
            if key is None or key.kind != "tokens":
                return f"the router cannot key the {endpoint} canary on tokens"
            try:
                r = await client.post(
                    url + ENGINE_PREFIX_BLOCKS_PATH,
                    json={"endpoint": endpoint, "request": request},
                    headers=self._headers,
                    timeout=POLL_TIMEOUT_S * 5,
                )
            except httpx.HTTPError as e:
                raise _NoAnswer(failure_reason(e)) from e
            if r.status_code == 404 and not _is_model_404(r):
                return f"the engine has no POST {ENGINE_PREFIX_BLOCKS_PATH} (404: an older engine)"
            if r.status_code >= 500:
                raise _NoAnswer(status_reason(r.status_code, "POST", ENGINE_PREFIX_BLOCKS_PATH))
            if r.status_code != 200:
                answered = status_reason(r.status_code, "POST", ENGINE_PREFIX_BLOCKS_PATH)
                return f"the engine refused the {endpoint} canary: {answered}"
            try:
                body = r.json()
                engine_bt, engine_tokens = _int(body, "block_tokens"), _int(body, "prompt_tokens")
                engine_blocks = [int(h) for h in body["blocks"]]
            except (ValueError, KeyError, TypeError) as e:
                return f"the engine's {ENGINE_PREFIX_BLOCKS_PATH} answer is not one ({type(e).__name__})"
            why = _parity_mismatch(endpoint, key, engine_bt, engine_tokens, engine_blocks)
            if why is not None:
                return why
        return None

    # ------------------------------------------------------------------------------------------------ state
    def _evaluate(self, f: CacheFollower, w: WorkerState) -> None:
        state, reason = self._derive(f, w)
        f.reason = reason
        if state != f.state:
            old, f.state = f.state, state
            self._publish(f)
            if state == "exact":  # good news: INFO, as the pool's recovery lines
                logger.info("worker %s cache state exact (was %s): %s", f.url, old, reason)
            else:
                logger.warning("worker %s cache state %s (was %s): %s", f.url, state, old, reason)

    def _derive(self, f: CacheFollower, w: WorkerState) -> tuple[CacheState, str]:
        view = f.view
        if f.no_events is not None:
            return "degraded", f.no_events + "; routing on the router's predictions"
        if f.failures >= UNREACHABLE_AFTER_POLLS:
            return "unknown", f"the engine does not answer ({f.last_error})"
        if not view.synced:
            return ("unknown", f.last_error) if f.last_error else ("unknown", "not synced yet")
        bt = int(self.extractor.block_tokens)
        if view.block_tokens != bt:
            return "degraded", (
                f"the engine's blocks are {view.block_tokens} tokens, the router's --block-tokens {bt}; routing on "
                "the router's predictions"
            )
        model = w.models[0]
        if not self.extractor.has_tokenizer(model):
            return "degraded", (
                f"the router has no tokenizer for {model} (it keys on characters, the engine on tokens); routing on "
                "the router's predictions"
            )
        if view.model not in w.models:
            return "degraded", f"the engine hashes blocks of model {view.model!r}, it serves {', '.join(w.models)}"
        if f.parity_checked is None:
            return "unknown", "parity not checked yet"
        if f.parity is not None:
            return "degraded", f"parity failed: {f.parity}; routing on the router's predictions"
        if f.failures:
            return f.state, f.reason  # one lost poll: keep what it was
        return "exact", "following the engine's cache events; parity ok"

    def _publish(self, f: CacheFollower) -> None:
        if self.metrics is None:
            return
        gauges = self._gauges.get(f.url)
        if gauges is None:
            gauges = self._gauges[f.url] = {s: self.metrics.worker_cache_state.labels(f.url, s) for s in CACHE_STATES}
        for s, g in gauges.items():
            g.set(1 if s == f.state else 0)


def _is_model_404(r: httpx.Response) -> bool:
    """A 404 about the request's model (the engine has the route), not a missing route."""
    try:
        return r.json()["error"]["param"] in ("request.model", "model")
    except (ValueError, KeyError, TypeError):
        return False


def _parity_mismatch(
    endpoint: str, key: PrefixKey, engine_bt: int, engine_tokens: int, engine_blocks: list[int]
) -> str | None:
    """Why the router's ``key`` of a canary differs from the engine's blocks of it, or None."""
    if engine_bt != key.block_tokens:
        return f"the engine's blocks are {engine_bt} tokens, the router's --block-tokens {key.block_tokens}"
    if engine_tokens != key.prompt_tokens:
        return (
            f"the engine renders the {endpoint} canary as {engine_tokens} tokens, the router as {key.prompt_tokens} "
            "(another chat template or tokenizer?)"
        )
    if list(key.blocks) != engine_blocks:
        first = next((i for i, (a, b) in enumerate(zip(key.blocks, engine_blocks, strict=False)) if a != b), None)
        where = f"block {first}" if first is not None else "the block count"
        return (
            f"the {endpoint} canary's block hashes differ from {where} on (of {len(engine_blocks)}; another "
            "chat template, tokenizer or hash namespace?)"
        )
    return None


def _path(e: httpx.HTTPError) -> str:
    try:
        return e.request.url.path
    except RuntimeError:
        return "?"


# ------------------------------------------------------------------------------------------------ wiring


def attach(policy: RoutingPolicy, tracker: CacheStateTracker) -> bool:
    """Make ``tracker`` the match source of ``policy`` (an ``IndexedPolicy``: its ``oracle``) and give the tracker
    the policy's ``PrefixIndex`` to fall back on. False (nothing done) for another policy or a disabled tracker."""
    if not isinstance(policy, IndexedPolicy) or not tracker.enabled:
        return False
    tracker.index = policy.index
    tracker.dispatched.capacity = policy.index.capacity
    policy.oracle = tracker
    return True


def cacheable_tokens(policy: RoutingPolicy, key: PrefixKey | None, workers: Iterable[str]) -> int:
    """The prompt tokens of ``key`` some worker of ``workers`` holds (or is predicted to): the largest
    ``predicted_cached_tokens`` over them; 0 without a key or for a policy without predictions. Call it before the
    request is recorded (its own dispatch would count)."""
    if key is None or not key.blocks or not isinstance(policy, IndexedPolicy):
        return 0
    return max((policy.predicted_cached_tokens(url, key) for url in workers), default=0)
