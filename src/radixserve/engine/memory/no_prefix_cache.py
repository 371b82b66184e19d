"""A prefix cache that caches nothing (``--disable-radix-cache``), with ``RadixCache``'s interface.

The scheduler talks to one cache object either way instead of checking a flag at every call site (mini-sglang's
``create_prefix_cache`` picks a naive cache the same way, python/minisgl/kvcache/). Every match misses, locks are
no-ops, nothing is evictable, and ``insert`` keeps nothing: the caller still owns every slot and, since a match
afterwards covers 0 tokens, frees them itself when the request lets go of its KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.engine.memory.allocator import TokenSlotAllocator
from radixserve.engine.memory.radix_cache import MatchResult, TreeNode


class NoPrefixCache:
    """``RadixCache`` without a tree: same methods, nothing cached.

    ``disable`` is True (what ``RadixCache(disable=True)`` reported), so code that may share KV only through a
    cache (parallel sampling's single prefill, cache-aware queue ordering) can ask the cache instead of the flags.
    """

    disable = True

    def __init__(self, allocator: TokenSlotAllocator):
        self.allocator = allocator
        self._empty = torch.empty(0, dtype=torch.int64, device=allocator.device)
        self.root = TreeNode([], self._empty, None, 0)

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Always a miss: no slots, the root."""
        return MatchResult(self._empty, self.root)

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Keep nothing; returns 0 (no token was present). Raises ValueError when the lengths differ, as
        ``RadixCache.insert``."""
        if len(token_ids) != slots.numel():
            raise ValueError(f"{len(token_ids)} token ids but {slots.numel()} slots")
        return 0

    def inc_lock_ref(self, node: TreeNode) -> None:
        """No-op (only the root is ever handed out)."""

    def dec_lock_ref(self, node: TreeNode) -> None:
        """No-op."""

    def evict(self, num_tokens: int) -> int:
        """Nothing to evict; returns 0."""
        return 0

    def reset(self) -> None:
        """Nothing to flush."""

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def pretty(self) -> str:
        return "no prefix cache (disabled)"
