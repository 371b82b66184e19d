"""The batch one model forward runs over: new tokens of several sequences plus where their KV lives in the pool.

Layout follows SGLang's ``ForwardBatch`` (srt/model_executor/forward_batch_info.py) and flashinfer's paged-KV CSR
format with page size 1: sequence ``i``'s whole context (cached prefix + new tokens) occupies KV slots
``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, in token order; the new tokens' slots (``out_cache_loc``) are the last
``extend_seq_lens[i]`` entries of that range.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    """EXTEND: prefill of new tokens after an optional cached prefix. DECODE: exactly one new token per sequence."""

    EXTEND = 1
    DECODE = 2


@dataclass
class ForwardBatch:
    """Inputs of one forward. All tensors live on the model's device; ``*_cpu`` lists mirror them to avoid syncs.

    Attributes:
        mode: EXTEND or DECODE.
        input_ids: int64 ``[num_tokens]``, the new tokens of all sequences concatenated in batch order.
        positions: int64 ``[num_tokens]``, absolute position of each new token.
        out_cache_loc: int64 ``[num_tokens]``, KV slot written for each new token.
        seq_lens: int64 ``[batch]``, KV length of each sequence after this forward (prefix + new).
        extend_seq_lens: int64 ``[batch]``, new tokens per sequence (all 1 in DECODE).
        kv_indptr: int64 ``[batch + 1]``, CSR offsets into ``kv_indices``.
        kv_indices: int64 ``[sum(seq_lens)]``, KV slots of each sequence's whole context, in order.
        seq_lens_cpu, extend_seq_lens_cpu: the same as Python lists.
    """

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]

    @property
    def batch_size(self) -> int:
        """Number of sequences in the batch."""
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        """Number of new tokens (rows of ``input_ids``)."""
        return int(self.input_ids.shape[0])

    def logits_indices(self) -> torch.Tensor:
        """int64 ``[batch]``: the row of each sequence's last new token (the rows whose logits are sampled)."""
        if self.mode == ForwardMode.DECODE:
            return torch.arange(self.batch_size, dtype=torch.int64, device=self.input_ids.device)
        return torch.cumsum(self.extend_seq_lens, 0) - 1

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: list[list[int]],
        kv_slots: list[list[int]],
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """Convenience constructor for tests and warmup (the scheduler builds batches from its own tables).

        Args:
            mode: EXTEND or DECODE.
            input_ids: per sequence, its new token ids.
            kv_slots: per sequence, the KV slots of its whole context (prefix + new); the last ``len(input_ids[i])``
                are the slots the new tokens are written to, and a token's position is its index in this list.
            device: device of the produced tensors.

        Raises:
            ValueError: when a sequence has more new tokens than context slots, or DECODE gets != 1 new token.
        """
        ext = [len(t) for t in input_ids]
        lens = [len(s) for s in kv_slots]
        if len(ext) != len(lens) or any(e > n or e == 0 for e, n in zip(ext, lens)):
            raise ValueError("each sequence needs 1..len(kv_slots) new tokens")
        if mode == ForwardMode.DECODE and any(e != 1 for e in ext):
            raise ValueError("DECODE takes exactly one new token per sequence")
        positions = [p for e, n in zip(ext, lens) for p in range(n - e, n)]
        out_loc = [s for e, sl in zip(ext, kv_slots) for s in sl[len(sl) - e :]]
        indptr = [0]
        for n in lens:
            indptr.append(indptr[-1] + n)

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            mode=mode,
            input_ids=t([i for ids in input_ids for i in ids]),
            positions=t(positions),
            out_cache_loc=t(out_loc),
            seq_lens=t(lens),
            extend_seq_lens=t(ext),
            kv_indptr=t(indptr),
            kv_indices=t([s for sl in kv_slots for s in sl]),
            seq_lens_cpu=lens,
            extend_seq_lens_cpu=ext,
        )
