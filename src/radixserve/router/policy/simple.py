"""Load-only routing policies (``least_load``, ``round_robin``, ``power_of_two``) and the base every policy shares.

All policies keep a ``PrefixIndex`` of what they sent where, so ``predicted_cached_tokens`` is reported for every
policy (the prefix-blind ones included: that is what makes their hit rates comparable in metrics and benchmarks).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from radixserve.router.prefix_index import PrefixIndex
from radixserve.router.types import CacheOracle, PrefixKey, RouteDecision, RouteReason, WorkerLoad


def load_order(w: WorkerLoad) -> tuple[int, int, str]:
    """Sort key, least loaded first: tokens of load (``WorkerLoad.load``), then in-flight requests, then URL
    (deterministic ties)."""
    return (w.load, w.inflight_requests, w.url)


class IndexedPolicy:
    """Base of the policies: the ``PrefixIndex`` bookkeeping (``record``, ``forget_worker``) and decisions with
    their predicted cached tokens. Subclasses implement ``rank``."""

    name = "base"

    def __init__(self, capacity_blocks_per_worker: int = 65536):
        self.index = PrefixIndex(capacity_blocks_per_worker)
        # The match source when set (router/cache_state.py: engine-reported caches, the index for the others).
        self.oracle: CacheOracle | None = None

    def match(self, worker: str, blocks: Sequence[int]) -> int:
        """Leading blocks of ``blocks`` ``worker`` holds: the ``oracle``'s answer, else the index's prediction."""
        if self.oracle is not None:
            return self.oracle.match(worker, blocks)
        return self.index.match(worker, blocks)

    def set_workers(self, urls: Sequence[str]) -> None:
        """Load-only policies need no ring; the workers come with every ``rank`` call."""

    def record(self, worker: str, key: PrefixKey) -> None:
        """The request with ``key`` went to ``worker``: its prompt blocks are now cached there."""
        self.index.record(worker, key.blocks)
        if self.oracle is not None:
            self.oracle.record(worker, key.blocks)

    def forget_worker(self, worker: str) -> None:
        """``worker`` left: its cache is gone."""
        self.index.forget(worker)

    def predicted_cached_tokens(self, worker: str, key: PrefixKey | None) -> int:
        """Matched blocks × ``key.block_tokens``, capped at ``prompt_tokens - 1`` (the engine always computes the
        last prompt token); 0 without a key."""
        if key is None:
            return 0
        matched = self.match(worker, key.blocks)
        return max(0, min(matched * key.block_tokens, key.prompt_tokens - 1))

    def decide(self, worker: str, reason: RouteReason, key: PrefixKey | None) -> RouteDecision:
        """One ranked candidate with its predicted cached tokens."""
        return RouteDecision(worker, reason, self.predicted_cached_tokens(worker, key))


class LeastLoadPolicy(IndexedPolicy):
    """Least in-flight tokens first (ties: fewer in-flight requests, then URL). Reason "fallback": not prefix-routed."""

    name = "least_load"

    def rank(self, key: PrefixKey | None, workers: Sequence[WorkerLoad], cost_tokens: int) -> list[RouteDecision]:
        """Every worker of ``workers`` once, least loaded first."""
        return [self.decide(w.url, "fallback", key) for w in sorted(workers, key=load_order)]


class RoundRobinPolicy(IndexedPolicy):
    """A rotating counter over the workers sorted by URL; the rest of the ranking continues the rotation."""

    name = "round_robin"

    def __init__(self, capacity_blocks_per_worker: int = 65536):
        super().__init__(capacity_blocks_per_worker)
        self._next = 0

    def rank(self, key: PrefixKey | None, workers: Sequence[WorkerLoad], cost_tokens: int) -> list[RouteDecision]:
        """Every worker of ``workers`` once, starting at the counter (which then advances by one)."""
        urls = sorted(w.url for w in workers)
        if not urls:
            return []
        start = self._next % len(urls)
        self._next += 1
        return [self.decide(u, "fallback", key) for u in urls[start:] + urls[:start]]


class PowerOfTwoPolicy(IndexedPolicy):
    """Power of two choices (Mitzenmacher 2001): sample two distinct workers, take the one with fewer in-flight
    tokens; the rest of the ranking is least loaded first. ``seed`` makes the sampling reproducible."""

    name = "power_of_two"

    def __init__(self, capacity_blocks_per_worker: int = 65536, seed: int | None = None):
        super().__init__(capacity_blocks_per_worker)
        self._rng = random.Random(seed)

    def rank(self, key: PrefixKey | None, workers: Sequence[WorkerLoad], cost_tokens: int) -> list[RouteDecision]:
        """Every worker of ``workers`` once: the better of two random ones, the other, then the rest by load."""
        ordered = sorted(workers, key=load_order)  # sampling from a sorted list: same seed, same choices
        if len(ordered) <= 2:
            picked = ordered
        else:
            picked = sorted(self._rng.sample(ordered, 2), key=load_order)
        chosen = {id(w) for w in picked}
        rest = [w for w in ordered if id(w) not in chosen]
        return [self.decide(w.url, "fallback", key) for w in picked + rest]
