"""flashinfer attention (Ye et al. 2025, https://docs.flashinfer.ai) over the slot-indexed KV pool on CUDA.

The pool is viewed as a paged KV cache with page size 1 in ``NHD`` layout: ``k_buffers[layer]`` ``[num_slots, Hkv, D]``
becomes ``[num_pages=num_slots, page_size=1, Hkv, D]``, so ``ForwardBatch.kv_indptr``/``kv_indices`` are exactly
flashinfer's CSR page table and every ``last_page_len`` is 1 (SGLang's flashinfer_backend.py does the same).
EXTEND runs ``BatchPrefillWithPagedKVCacheWrapper`` with ``causal=True`` (flashinfer aligns the new tokens to the end
of each sequence's KV, i.e. causal within the new tokens and full over the prefix); DECODE runs
``BatchDecodeWithPagedKVCacheWrapper``. Plans are made once per forward in ``init_forward_metadata``. flashinfer is
imported here only, and this module is imported only when CUDA is available.
"""

from __future__ import annotations

import torch

from radixserve.engine.attention.base import AttentionBackend
from radixserve.engine.memory.kv_pool import KVPool
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's documented default float workspace


class FlashInferBackend(AttentionBackend):
    """Batched paged prefill/decode kernels of flashinfer. Needs CUDA and fp16/bf16 ``dtype`` (q and KV)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        scale: float | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        import flashinfer  # lazy: CUDA hosts only

        self.dtype, self.device = dtype, device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # tensor-core decode pays off for large GQA groups (SGLang's should_use_tensor_core heuristic)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.group >= 4
        )
        self._mode: ForwardMode | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan the prefill or decode kernel for this batch's page table (host-side indptr: no device sync)."""
        B = batch.batch_size
        kv_indptr = torch.tensor([0] + _cumsum(batch.seq_lens_cpu), dtype=torch.int32)  # CPU
        kv_indices = batch.kv_indices.to(device=self.device, dtype=torch.int32)
        last_page_len = torch.ones(B, dtype=torch.int32)
        self._mode = batch.mode
        if batch.mode == ForwardMode.DECODE:
            self.decode.plan(
                kv_indptr,
                kv_indices,
                last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                1,
                pos_encoding_mode="NONE",
                sm_scale=self.scale,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
        else:
            qo_indptr = torch.tensor([0] + _cumsum(batch.extend_seq_lens_cpu), dtype=torch.int32)
            self.prefill.plan(
                qo_indptr,
                kv_indptr,
                kv_indices,
                last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                1,
                causal=True,
                pos_encoding_mode="NONE",
                sm_scale=self.scale,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, kv_pool: KVPool, batch: ForwardBatch
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``: ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, Hq*D]``."""
        kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = kv_pool.get_kv(layer_id)
        paged = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))  # [num_slots, page_size=1, Hkv, D]
        wrapper = self.decode if self._mode == ForwardMode.DECODE else self.prefill
        o: torch.Tensor = wrapper.run(q.contiguous(), paged)  # flashinfer is untyped
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)


def _cumsum(xs: list[int]) -> list[int]:
    out, acc = [], 0
    for x in xs:
        acc += x
        out.append(acc)
    return out
