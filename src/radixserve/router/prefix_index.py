"""An approximate view of what each worker's radix cache holds, from the requests this router sent it.

SGLang's cache-aware router keeps an approximate radix tree of request text per worker. We keep the chained block
hashes of ``PrefixKey.blocks`` instead: a chained hash names its whole prefix, so a set of hashes per worker is the
same tree, flattened. Eviction is LRU per worker, leaves first, like the engine's radix cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence


class PrefixIndex:
    """Per-worker sets of chained block hashes, each capped at ``capacity_blocks_per_worker`` (LRU).

    ``record`` touches a prompt's blocks deepest first, so a block is never older than any of its descendants and
    LRU eviction removes leaves before their parents. The set a worker holds is therefore always prefix-closed
    (block ``i`` present implies blocks ``0..i-1`` present), which makes ``match`` a binary search.
    Every call is O(len(blocks)) (``match`` O(log len(blocks))).
    """

    def __init__(self, capacity_blocks_per_worker: int = 65536):
        if capacity_blocks_per_worker < 1:
            raise ValueError("capacity_blocks_per_worker must be >= 1")
        self.capacity = capacity_blocks_per_worker
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def record(self, worker: str, blocks: Sequence[int]) -> None:
        """``worker`` now caches the prefix whose chained block hashes are ``blocks``."""
        cached = self._blocks.setdefault(worker, OrderedDict())
        for h in reversed(blocks):  # deepest first: parents end up most recently used
            if h in cached:
                cached.move_to_end(h)
            else:
                cached[h] = None
        while len(cached) > self.capacity:
            cached.popitem(last=False)

    def match(self, worker: str, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` ``worker`` is predicted to cache (0 for an unknown worker)."""
        cached = self._blocks.get(worker)
        return prefix_match(cached, blocks) if cached else 0

    def forget(self, worker: str) -> None:
        """``worker`` left or restarted: its cache is gone."""
        self._blocks.pop(worker, None)

    def size(self, worker: str) -> int:
        """How many blocks are recorded for ``worker``."""
        cached = self._blocks.get(worker)
        return len(cached) if cached else 0


def prefix_match(held: Container[int], blocks: Sequence[int]) -> int:
    """How many leading blocks of ``blocks`` are in ``held`` (a set or mapping of chained block hashes that is
    prefix-closed, as a radix cache's blocks are: a binary search)."""
    if not blocks or blocks[0] not in held:
        return 0
    lo, hi = 1, len(blocks)  # invariant: blocks[lo - 1] held; answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo
