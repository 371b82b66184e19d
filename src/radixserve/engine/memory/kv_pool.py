"""Slot-indexed KV cache pool: one K and one V buffer per layer, one row per token slot (page size 1).

Design after SGLang's ``MHATokenToKVPool`` (srt/mem_cache/memory_pool.py) and mini-sglang's ``mha_pool``: the
scheduler hands out slot ids; the attention backend writes new K/V at ``out_cache_loc`` and reads a sequence's context
by gathering its slots. Slot 0 is a reserved dummy slot (padding and warmup write there).
"""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K/V buffers ``k_buffers[layer]``, ``v_buffers[layer]``, each ``[num_slots, num_kv_heads, head_dim]``.

    Slot 0 is the dummy slot; usable slots are ``1 .. num_slots - 1``.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """Allocate ``2 * num_layers`` zero-filled buffers. Raises ValueError when ``num_slots < 2``."""
        if num_slots < 2:
            raise ValueError(f"KV pool needs at least 2 slots (slot 0 is reserved), got {num_slots}")
        self.size = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, num_kv_heads, head_dim)
        # zeros, not empty: padded gathers read slot 0 and must see finite values
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` (``[N, num_kv_heads, head_dim]``) into int64 ``slots`` ``[N]`` of layer ``layer_id``."""
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        self.k_buffers[layer_id].index_copy_(0, slots, k)
        self.v_buffers[layer_id].index_copy_(0, slots, v)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V buffers of one layer, each ``[num_slots, num_kv_heads, head_dim]``."""
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def bytes_per_token(self) -> int:
        """Bytes of K+V one token slot takes over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """``bytes_per_token`` before a pool exists (to size it)."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    def total_bytes(self) -> int:
        """Bytes held by all buffers."""
        return self.size * self.bytes_per_token()
