"""KV slot allocation: a free-slot allocator over token slots and the request -> token -> slot table.

Page size is 1: one KV slot holds one token's K and V in every layer (the tensors live in ``kv_pool.py``). The design
follows SGLang's ``TokenToKVPoolAllocator`` / ``ReqToTokenPool`` (python/sglang/srt/mem_cache/): the free list is an
int64 tensor that ``alloc`` slices from the front, and ``free`` only appends the released tensor to a pending list that
is concatenated lazily, so both are O(n) in the number of slots moved, never O(pool size).
"""

from __future__ import annotations

import torch


class TokenSlotAllocator:
    """Free-slot allocator over KV slots ``1..size``.

    Slot 0 is reserved as a padding/dummy slot (padded batch entries write their KV there) and is never handed out, so
    the KV pool must have ``size + 1`` rows.

    Args:
        size: usable slots (tokens), >= 0.
        device: device of the slot-id tensors (the KV pool's device, so slot ids index it without a copy).
        check: debug mode. ``free`` then raises ``ValueError`` on slot 0, out-of-range slots, duplicate slots and
            double frees, and ``alloc`` marks slots as used. Costs O(n) per call and O(size) memory once.
    """

    def __init__(self, size: int, device: str | torch.device = "cpu", check: bool = False):
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self.size = size
        self.device = torch.device(device)
        self.check = check
        self.clear()

    def clear(self) -> None:
        """Make every slot ``1..size`` free again (drops all outstanding allocations)."""
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        # Tensors given back by free() and not yet merged into self._free (merged on demand by alloc).
        self._released: list[torch.Tensor] = []
        self._num_released = 0
        # Debug bookkeeping: is_free[slot] for slot in 0..size; slot 0 is never free.
        self._is_free: torch.Tensor | None = None
        if self.check:
            self._is_free = torch.ones(self.size + 1, dtype=torch.bool, device=self.device)
            self._is_free[0] = False

    def available(self) -> int:
        """Number of free slots."""
        return self._free.numel() + self._num_released

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` free slots.

        Returns:
            int64 tensor ``[n]`` of distinct slot ids in ``1..size``, or ``None`` (allocating nothing) if fewer than
            ``n`` slots are free.
        Raises:
            ValueError: ``n < 0``.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._free.numel():
            if n > self.available():
                return None
            self._merge()
        out = self._free[:n]
        self._free = self._free[n:]
        if self._is_free is not None:
            self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Give slots back. ``slots``: int64 tensor ``[n]`` (``n`` may be 0) of slots obtained from ``alloc``.

        O(n): the tensor is copied and queued, and merged into the free list on a later ``alloc`` that needs it.

        Raises:
            ValueError: (debug mode only) slot 0, a slot outside ``1..size``, a duplicate, or a slot already free.
        """
        n = slots.numel()
        if n == 0:
            return
        # Copy: callers often pass a view of req_to_token whose row is reused right after.
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64, copy=True)
        if self._is_free is not None:
            self._check_free(slots)
            self._is_free[slots] = True
        self._released.append(slots)
        self._num_released += n

    def free_slots(self) -> torch.Tensor:
        """All free slot ids, int64 ``[available()]`` (debugging and tests; merges the pending list)."""
        self._merge()
        return self._free.clone()

    def _merge(self) -> None:
        if self._released:
            self._free = torch.cat([self._free, *self._released])
            self._released = []
            self._num_released = 0

    def _check_free(self, slots: torch.Tensor) -> None:
        assert self._is_free is not None
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 1 or hi > self.size:
            raise ValueError(f"freeing slot outside 1..{self.size} (min {lo}, max {hi}); slot 0 is reserved")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("freeing the same slot twice in one call")
        already = slots[self._is_free[slots]]
        if already.numel():
            raise ValueError(f"double free of slots {already[:8].tolist()}")


class ReqToTokenPool:
    """Maps a request row to its token -> KV slot table (SGLang's ``ReqToTokenPool``).

    ``req_to_token[row, i]`` is the KV slot of the request's token ``i``; the attention backend gathers a request's
    K/V through it. Rows are handed out by ``alloc`` and returned by ``free``; row contents are not cleared.

    Args:
        max_reqs: number of rows (max concurrently running requests).
        max_context_len: columns (max tokens per request).
        device: device of ``req_to_token``.

    Attributes:
        req_to_token: int64 ``[max_reqs, max_context_len]``, zero-initialised (0 is the dummy slot).
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: str | torch.device = "cpu"):
        if max_reqs < 0 or max_context_len < 0:
            raise ValueError(f"bad shape ({max_reqs}, {max_context_len})")
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int64, device=device)
        self._free_rows = list(range(max_reqs - 1, -1, -1))  # pop() from the end hands out row 0 first
        self._row_free = [True] * max_reqs

    def available(self) -> int:
        """Number of free rows."""
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """Take a free row index, or ``None`` when all rows are in use."""
        if not self._free_rows:
            return None
        idx = self._free_rows.pop()
        self._row_free[idx] = False
        return idx

    def free(self, idx: int) -> None:
        """Return row ``idx``.

        Raises:
            ValueError: ``idx`` out of range or already free (O(1) check).
        """
        if not 0 <= idx < self.max_reqs:
            raise ValueError(f"row {idx} outside 0..{self.max_reqs - 1}")
        if self._row_free[idx]:
            raise ValueError(f"double free of request row {idx}")
        self._row_free[idx] = True
        self._free_rows.append(idx)

    def clear(self) -> None:
        """Make every row free again."""
        self._free_rows = list(range(self.max_reqs - 1, -1, -1))
        self._row_free = [True] * self.max_reqs
