"""KV accounting of the scheduler: slots, request rows and the prefix cache behind one ``cache_req`` entry point.

After mini-sglang's ``CacheManager`` (python/minisgl/scheduler/cache.py) and SGLang's ``cache_finished_req`` /
``cache_unfinished_req`` (srt/mem_cache/radix_cache.py). Page size 1.

Per request (``Req``), ``req_to_token[req_pool_idx, :kv_len]`` holds the slots of ``fill_ids[:kv_len]``:

- ``[0, prefix_len)``: owned by the prefix cache, kept alive by the lock on ``last_node``;
- ``[prefix_len, kv_len)``: allocated for this request (``alloc_slots``), owned by it until ``cache_req``.

``cache_req(req, finished)`` hands the request's computed KV to the cache: what the cache now holds is re-pointed
to the cache's slots and locked, duplicates (tokens another request cached meanwhile) are freed. With
``finished`` (the request ends or is retracted) the lock and the row are released and what the cache did not keep
(all of it with ``NoPrefixCache``) goes back to the allocator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from radixserve.engine.memory.allocator import ReqToTokenPool, TokenSlotAllocator
from radixserve.engine.memory.radix_cache import MatchResult, TreeNode
from radixserve.engine.scheduler.request import Req


class PrefixCache(Protocol):
    """What the scheduler needs of a prefix cache: ``RadixCache`` or ``NoPrefixCache``."""

    disable: bool

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult: ...
    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int: ...
    def inc_lock_ref(self, node: TreeNode) -> None: ...
    def dec_lock_ref(self, node: TreeNode) -> None: ...
    def evict(self, num_tokens: int) -> int: ...
    def reset(self) -> None: ...
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def total_size(self) -> int: ...


class KVCacheManager:
    """Owns the slot allocator, the request -> token -> slot table and the prefix cache.

    Args:
        allocator: free KV slots.
        req_to_token_pool: request rows.
        cache: the prefix cache over ``allocator``'s slots (``RadixCache`` or ``NoPrefixCache``).
    """

    def __init__(self, allocator: TokenSlotAllocator, req_to_token_pool: ReqToTokenPool, cache: PrefixCache):
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.cache = cache

    @property
    def shares_prefixes(self) -> bool:
        """True when requests can share KV through the cache (so ``n`` samples can prefill once and fork)."""
        return not self.cache.disable

    def available_size(self) -> int:
        """Slots a request could get now: free plus evictable, tokens."""
        return self.allocator.available() + self.cache.evictable_size()

    def used_tokens(self) -> int:
        """Slots not free (held by requests or the cache), tokens."""
        return self.allocator.size - self.allocator.available()

    def match(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``token_ids`` (not locked: ``lock`` it before anything may evict)."""
        return self.cache.match_prefix(token_ids)

    def lock(self, node: TreeNode) -> None:
        self.cache.inc_lock_ref(node)

    def unlock(self, node: TreeNode) -> None:
        self.cache.dec_lock_ref(node)

    def assign(self, req: Req, match: MatchResult) -> bool:
        """Give ``req`` a table row holding its cached prefix ``match`` (already locked by the caller).

        Returns False (nothing changed) when no row is free."""
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return False
        req.req_pool_idx = idx
        req.last_node = match.last_node
        req.prefix_len = match.prefix_len
        if req.prefix_len:
            self.req_to_token[idx, : req.prefix_len] = match.slots
        req.kv_len = req.prefix_len
        return True

    def alloc_slots(self, n: int) -> torch.Tensor:
        """``n`` free slots, int64 ``[n]``, evicting unlocked cache leaves when needed.

        Raises:
            MemoryError: fewer than ``n`` slots are free even after eviction.
        """
        if self.allocator.available() < n:
            self.cache.evict(n - self.allocator.available())
        slots = self.allocator.alloc(n)
        if slots is None:
            raise MemoryError(f"KV pool exhausted: need {n} slots, {self.allocator.available()} free")
        return slots

    def alloc_extend(self, req: Req) -> None:
        """Slots for the ``req.extend_len`` tokens after ``req.kv_len``, written into its row (raises MemoryError)."""
        assert req.req_pool_idx is not None
        slots = self.alloc_slots(req.extend_len)
        self.req_to_token[req.req_pool_idx, req.kv_len : req.kv_len + req.extend_len] = slots

    def fork(self, parent: Req, child: Req) -> None:
        """Give ``child`` a row sharing ``parent``'s computed KV (all of it cached: ``cache_req`` ran on the parent)
        and its own lock on the shared prefix. Raises RuntimeError when no row is free (admission reserves one)."""
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            raise RuntimeError("no request row for a parallel sample; admission reserves one per sample")
        assert parent.req_pool_idx is not None
        child.req_pool_idx = idx
        child.prefix_len = parent.prefix_len
        child.kv_len = parent.kv_len
        child.last_node = parent.last_node
        self.lock(child.last_node)
        self.req_to_token[idx, : parent.kv_len] = self.req_to_token[parent.req_pool_idx, : parent.kv_len]

    def cache_req(self, req: Req, finished: bool) -> None:
        """Insert ``req``'s computed KV (``fill_ids[:kv_len]``) into the prefix cache.

        Not ``finished`` (a prefill chunk is done, or the prompt is, before decoding): the request keeps its row,
        its table now points at the cache's slots for what the cache holds, and its lock moves to the new deepest
        node. ``finished`` (the request ends or is retracted): the lock and the row are released, slots the cache
        did not keep are freed, and the request forgets its KV placement (``Req.reset_kv_state``). A request that
        never got a row is left alone.
        """
        row = req.req_pool_idx
        if row is None:
            return
        kv_len = req.kv_len
        old_node = req.last_node
        if kv_len:
            tokens = req.fill_ids[:kv_len]
            slots = self.req_to_token[row, :kv_len].clone()  # a copy: the row is rewritten or reused below
            present = self.cache.insert(tokens, slots)  # the cache now owns what it kept of slots[present:]
            if present > req.prefix_len:
                # The cache already had tokens [prefix_len, present) under other slots: ours are duplicates.
                self.allocator.free(slots[req.prefix_len : present])
            match = self.cache.match_prefix(tokens)
            held = match.prefix_len  # kv_len with a radix tree, 0 with NoPrefixCache; never below present
            if finished:
                if held < kv_len:  # the tail the cache did not keep
                    self.allocator.free(slots[held:])
            else:
                self.req_to_token[row, :held] = match.slots
                self.lock(match.last_node)
                req.last_node = match.last_node
                req.prefix_len = held
        if old_node is not None and (finished or kv_len):
            self.unlock(old_node)
        if finished:
            self.req_to_token_pool.free(row)
            req.reset_kv_state()

    def flush(self) -> None:
        """Drop every cached prefix (raises RuntimeError while a request holds a lock)."""
        self.cache.reset()

    def check_idle(self) -> None:
        """Raise AssertionError unless every slot and row is free or in the cache unlocked (no request in flight)."""
        assert self.cache.protected_size() == 0, f"{self.cache.protected_size()} cached tokens still locked"
        free = self.allocator.available() + self.cache.evictable_size()
        assert free == self.allocator.size, f"{self.allocator.size - free} KV slots leaked"
        rows = self.req_to_token_pool
        assert rows.available() == rows.max_reqs, f"{rows.max_reqs - rows.available()} request rows leaked"
