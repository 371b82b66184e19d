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
    worker that served the first of them; 0 counts any match. Raises ``ValueError`` for ``virtual_nodes < 1``,
    ``load_factor < 1``, ``balance_abs_tokens < 0`` or ``cache_threshold`` outside [0, 1].
    """

    name = "prefix_hash"

    def __init__(
        self,
        virtual_nodes: int = 256,
        load_factor: float = 1.25,
        capacity_blocks_per_worker: int = 65536,
        balance_abs_tokens: int = 2048,
        cache_threshold: float = 0.5,
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
        total = sum(w.inflight_tokens for w in by_url.values())
        least = min(w.inflight_tokens for w in by_url.values())
        n = len(by_url)
        # A match counts only from the threshold on (regression: the chat template's ~30-token system prompt made
        # every chat follow the engine that served the first one, as cache-affinity).
        blocks = len(key.blocks)
        matched = {url: self._affine(self.index.match(url, key.blocks), blocks) for url in order}
        held = any(matched.values())

        def fits(url: str) -> bool:
            load = by_url[url].inflight_tokens
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
        if not fitting:  # cannot happen (the least loaded fits); kept so a bad load view never drops a request
            choice = min(by_url.values(), key=load_order).url
            first = self.decide(choice, "fallback", key)
        else:
            # Affinity: a fitting worker that holds more of this prompt wins (turn n+1 of a short conversation, whose
            # first K blocks are still growing, stays on turn n's worker).
            choice = max(fitting, key=lambda u: matched[u])  # the first of the longest matches, in ring order
            first = self.decide(choice, reason(choice), key)
        rest = [self.decide(u, reason(u), key) for u in order if u != choice]
        return [first, *rest]
