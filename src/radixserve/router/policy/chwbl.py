"""``prefix_hash``: consistent hashing with bounded loads (CHWBL) on the prefix key, load counted in tokens.

Mirrokni, Thorup, Zadimoghaddam 2018, "Consistent Hashing with Bounded Loads": walk the hash ring clockwise from the
key to the first worker whose load stays under ``load_factor ×`` the mean. As KubeAI's PrefixHash load balancer, but
keyed on the engine's own token blocks (``PrefixKey.routing_key``) and with load in tokens in flight (uncached prompt
tokens + remaining max_tokens), not requests: one 8k-token prompt is not one 10-token prompt.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from hashlib import blake2b

from radixserve.router.policy.hot_prefix import HotPrefixTracker
from radixserve.router.policy.simple import IndexedPolicy, load_order
from radixserve.router.types import PrefixKey, RouteDecision, RouteReason, WorkerLoad


def ring_hash(label: str) -> int:
    """A ring position: 64-bit blake2b of ``label`` (same width as the prefix keys' hashes)."""
    return int.from_bytes(blake2b(label.encode("utf-8"), digest_size=8).digest(), "little")


class PrefixHashPolicy(IndexedPolicy):
    """CHWBL over ``virtual_nodes`` ring points per worker (position ``ring_hash(f"{url}#{i}")``).

    ``set_workers`` defines the ring; ``rank`` gets a subset (healthy workers of one model) and skips the others
    while walking, without rebuilding, so a worker that is ejected and readmitted gets exactly its keys back.
    ``cost`` is per worker: the request's tokens minus what that worker is predicted to hold cached (a later turn
    costs its holder only the new tokens, and a cold worker the whole prompt). A worker fits when
    ``load + cost <= load_factor * (total_load + cost) / n`` (the paper's bound, in tokens), or when its load exceeds
    the least loaded worker's by at most ``balance_abs_tokens``: below that, an imbalance costs less than the cache
    miss a spill causes (SGLang's router balances only past an absolute threshold too, 64 requests there). So the
    least loaded worker always fits, and a prompt larger than the mean load keeps its prefix affinity.

    A worker's predicted match counts (wins over the key's owner, reason ``cache-affinity``) only when it covers at
    least ``cache_threshold`` of the prompt's key blocks: SGLang's cache-aware router (``--cache-threshold``, match
    length over prompt length) does the same. Below it the request is ``cold`` on its key's owner, so fresh prompts
    that share only a short head (a chat template's system prompt) spread over the ring instead of all following the
    worker that served the first of them; 0 counts any match.

    Hot prefixes (``hot_prefix``, a ``HotPrefixTracker``; None = off): a group (one routing key) whose share of the
    demand exceeds one engine's fair share gets the first ``r`` workers of its ring walk as replicas. A replica that
    does not hold the group's head (its first ``prefix_blocks`` blocks) while another does is warmed deliberately
    by the next request (reason ``hot-prefix``; one prefill per new replica, not one per request); after that each
    request takes the fitting replica of least predicted cost, uncached prompt tokens plus load (``WorkerLoad.load``).
    So the load of one hot system prompt spreads over as many engines as its demand needs, while other groups keep
    their single owner. Raises ``ValueError`` for ``virtual_nodes < 1``, ``load_factor < 1``,
    ``balance_abs_tokens < 0`` or ``cache_threshold`` outside [0, 1].
    """

    name = "prefix_hash"

    def __init__(
        self,
        virtual_nodes: int = 256,
        load_factor: float = 1.25,
        capacity_blocks_per_worker: int = 65536,
        balance_abs_tokens: int = 2048,
        cache_threshold: float = 0.5,
        hot_prefix: HotPrefixTracker | None = None,
        prefix_blocks: int = 8,
    ):
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1 (1.25 = 125% of the mean load)")
        if balance_abs_tokens < 0:
            raise ValueError("balance_abs_tokens must be >= 0")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be between 0 and 1 (a fraction of the prompt's blocks)")
        super().__init__(capacity_blocks_per_worker)
        self.balance_abs_tokens = balance_abs_tokens
        self.cache_threshold = cache_threshold
        self.virtual_nodes = virtual_nodes
        self.load_factor = load_factor
        self.hot_prefix = hot_prefix
        self.prefix_blocks = prefix_blocks  # K of the routing key: the blocks a group's requests all share
        self._points: list[int] = []  # sorted ring positions
        self._owners: list[str] = []  # worker URL of each position
        self._ring_urls: frozenset[str] = frozenset()

    def set_workers(self, urls: Sequence[str]) -> None:
        """Rebuild the ring for ``urls``: O(V·N log(V·N)); only the changed worker's arcs move (consistent hashing)."""
        unique = sorted(set(urls))
        ring = sorted((ring_hash(f"{url}#{i}"), url) for url in unique for i in range(self.virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [u for _, u in ring]
        self._ring_urls = frozenset(unique)

    def walk(self, routing_key: int, urls: Sequence[str]) -> list[str]:
        """The distinct workers of ``urls`` met clockwise from ``routing_key`` (the first is the key's owner),
        then any of ``urls`` not on the ring, by URL."""
        wanted = set(urls)
        on_ring = wanted & self._ring_urls
        order: list[str] = []
        n = len(self._points)
        if on_ring:
            seen: set[str] = set()
            start = bisect_left(self._points, routing_key)
            for j in range(n):
                url = self._owners[(start + j) % n]
                if url in on_ring and url not in seen:
                    seen.add(url)
                    order.append(url)
                    if len(order) == len(on_ring):
                        break
        return order + sorted(wanted - on_ring)

    def record(self, worker: str, key: PrefixKey) -> None:
        """The request with ``key`` went to ``worker``: its blocks are cached there, and its group's demand grows."""
        super().record(worker, key)
        if self.hot_prefix is not None:
            self.hot_prefix.observe(key.routing_key, key.prompt_tokens)

    def _affine(self, matched: int, blocks: int) -> int:
        """``matched`` blocks of a prompt of ``blocks`` blocks if they reach ``cache_threshold`` of it, else 0."""
        return matched if matched and matched / blocks >= self.cache_threshold else 0

    def rank(self, key: PrefixKey | None, workers: Sequence[WorkerLoad], cost_tokens: int) -> list[RouteDecision]:
        """Every worker once: the choice (first fitting worker clockwise from the key, or a fitting worker with a
        strictly longer affine match), then the rest in ring-walk order, each with its ``reason``:
        ``cache-affinity`` when it is predicted to hold at least ``cache_threshold`` of this prompt's blocks
        (``PrefixIndex``: what this router sent it before); ``cold`` when it is the key's owner and no worker holds
        that much (a fresh prompt, one that shares only a short head with earlier ones, or one shorter than a
        block); ``load-spill`` otherwise (the owner, or the worker holding the prompt, was over its load bound).
        Least loaded first, reason ``fallback``, when ``key`` is None or no worker fits."""
        if not workers:
            return []
        if key is None:
            return [self.decide(w.url, "fallback", None) for w in sorted(workers, key=load_order)]
        by_url = {w.url: w for w in workers}
        order = self.walk(key.routing_key, list(by_url))
        total = sum(w.load for w in by_url.values())
        least = min(w.load for w in by_url.values())
        n = len(by_url)
        # A match counts only from the threshold on (regression: the chat template's ~30-token system prompt made
        # every chat follow the engine that served the first one, as cache-affinity).
        blocks = len(key.blocks)
        matched = {url: self._affine(self.match(url, key.blocks), blocks) for url in order}
        held = any(matched.values())

        def fits(url: str) -> bool:
            load = by_url[url].load
            cost = max(0, cost_tokens - self.predicted_cached_tokens(url, key))
            return load + cost <= self.load_factor * (total + cost) / n or load - least <= self.balance_abs_tokens

        def reason(url: str) -> RouteReason:
            # Words for what the router knows, not what the engine will find: the engine's own count of cached
            # tokens is in its usage (radixserve_router_actual_cached_tokens_total), after the fact.
            if matched[url]:
                return "cache-affinity"
            if url != owner:
                return "load-spill"
            # The owner holding none of it while another worker holds some: that worker was over its bound.
            return "load-spill" if held else "cold"

        fitting = [u for u in order if fits(u)]
        owner = order[0]
        hot = self._hot_choice(key, order, by_url, fitting)
        if hot is not None:
            choice, why = hot
            first = self.decide(choice, why, key)
        elif not fitting:  # cannot happen (the least loaded fits); kept so a bad load view never drops a request
            choice = min(by_url.values(), key=load_order).url
            first = self.decide(choice, "fallback", key)
        else:
            # Affinity: a fitting worker that holds more of this prompt wins (turn n+1 of a short conversation, whose
            # first K blocks are still growing, stays on turn n's worker).
            choice = max(fitting, key=lambda u: matched[u])  # the first of the longest matches, in ring order
            first = self.decide(choice, reason(choice), key)
        rest = [self.decide(u, reason(u), key) for u in order if u != choice]
        return [first, *rest]

    def _hot_choice(
        self, key: PrefixKey, order: list[str], by_url: dict[str, WorkerLoad], fitting: list[str]
    ) -> tuple[str, RouteReason] | None:
        """For a replicated (hot) group: the replica to use and why, or None (not hot, or no replica fits: the
        normal ring walk decides)."""
        if self.hot_prefix is None:
            return None
        now = self.hot_prefix.current(key.routing_key)
        busy = all(by_url[u].requests > 0 for u in order[:now])  # every router's requests, as the engine counts
        r = self.hot_prefix.replicas(key.routing_key, len(order), busy)
        if r <= 1:
            return None
        fit = set(fitting)
        replicas = [u for u in order[:r] if u in fit]
        if not replicas:
            return None
        raw = {u: self.match(u, key.blocks) for u in order[:r]}
        # The group's head: the first K blocks every request of the group shares (fewer if no replica holds them).
        head = min(max(raw.values()), self.prefix_blocks)
        if head:
            for u in replicas:  # ring order: the next replica to warm is always the same one
                if raw[u] < head:
                    return u, "hot-prefix"
        cost = {u: key.prompt_tokens - self.predicted_cached_tokens(u, key) + by_url[u].load for u in replicas}
        choice = min(replicas, key=lambda u: (cost[u], by_url[u].inflight_requests))
        return choice, ("cache-affinity" if raw[choice] else "cold")
