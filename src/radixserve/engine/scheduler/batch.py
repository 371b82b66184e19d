"""Batch building: the ``ForwardBatch`` of a prefill or decode step from the request -> token -> slot table.

Each sequence's whole context is ``req_to_token[req_pool_idx, :seq_len]`` (cached prefix + computed + new tokens);
the new tokens' slots are the last ``extend_len`` (1 in decode) of it. As SGLang's ``ScheduleBatch`` ->
``ForwardBatch`` (srt/managers/schedule_batch.py) and mini-sglang's ``_prepare_batch``, page size 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.scheduler.request import Req


def _int64(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _kv_indices(req_to_token: torch.Tensor, rows: list[int], seq_lens: list[int]) -> tuple[list[int], torch.Tensor]:
    """CSR offsets ``[batch + 1]`` and the concatenated slots of each row's first ``seq_lens[i]`` entries."""
    indptr = [0]
    for n in seq_lens:
        indptr.append(indptr[-1] + n)
    kv = torch.cat([req_to_token[row, :n] for row, n in zip(rows, seq_lens)])
    return indptr, kv


def extend_batch(reqs: Sequence[Req], req_to_token: torch.Tensor, device: torch.device) -> ForwardBatch:
    """The EXTEND batch of ``reqs``: tokens ``fill_ids[kv_len : kv_len + extend_len]`` of each, whose slots are
    already in ``req_to_token`` (``KVCacheManager.alloc_extend``)."""
    input_ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    seq_lens: list[int] = []
    extend_lens: list[int] = []
    for req in reqs:
        assert req.req_pool_idx is not None
        start, end = req.kv_len, req.kv_len + req.extend_len
        fill = req.fill_ids
        input_ids.extend(fill[start:end])
        positions.extend(range(start, end))
        rows.append(req.req_pool_idx)
        seq_lens.append(end)
        extend_lens.append(req.extend_len)
    out_loc = torch.cat([req_to_token[row, n - e : n] for row, n, e in zip(rows, seq_lens, extend_lens)])
    indptr, kv = _kv_indices(req_to_token, rows, seq_lens)
    return ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=_int64(input_ids, device),
        positions=_int64(positions, device),
        out_cache_loc=out_loc.to(device),
        seq_lens=_int64(seq_lens, device),
        extend_seq_lens=_int64(extend_lens, device),
        kv_indptr=_int64(indptr, device),
        kv_indices=kv.to(device),
        seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=extend_lens,
    )


def decode_batch(
    reqs: Sequence[Req], req_to_token: torch.Tensor, slots: torch.Tensor, device: torch.device
) -> ForwardBatch:
    """The DECODE batch of ``reqs``: each one's last generated token at position ``seq_len - 1``, written to
    ``slots[i]`` (int64 ``[len(reqs)]``, fresh from the allocator), which this records in ``req_to_token``.

    Per-step cost is a handful of torch calls whatever the batch (list -> tensor conversions are the expensive part
    on CPU, ~5-15 us each): the positions tensor serves the table write and the batch, and the lengths derive from it.
    """
    rows: list[int] = []
    positions: list[int] = []
    input_ids: list[int] = []
    for req in reqs:
        assert req.req_pool_idx is not None
        rows.append(req.req_pool_idx)
        positions.append(req.seq_len - 1)
        input_ids.append(req.output_ids[-1])
    seq_lens = [p + 1 for p in positions]
    pos_t = torch.tensor(positions, dtype=torch.int64)
    req_to_token.index_put_((torch.tensor(rows, dtype=torch.int64), pos_t), slots)  # one write for the batch
    indptr, kv = _kv_indices(req_to_token, rows, seq_lens)
    ones = [1] * len(reqs)
    return ForwardBatch(
        mode=ForwardMode.DECODE,
        input_ids=_int64(input_ids, device),
        positions=pos_t.to(device),
        out_cache_loc=slots.to(device),
        seq_lens=(pos_t + 1).to(device),
        extend_seq_lens=torch.ones(len(reqs), dtype=torch.int64, device=device),
        kv_indptr=_int64(indptr, device),
        kv_indices=kv.to(device),
        seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=ones,
    )
