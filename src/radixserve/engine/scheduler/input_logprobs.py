"""Prompt-token logprobs (``GenerateRequest.logprob_start_len``) on the scheduler side.

Position ``p``'s logits predict token ``p + 1``, so a request asking for prompt logprobs from position ``s`` needs the
logits of positions ``max(s - 1, 0) .. prompt_len - 2`` (``Req.input_logprob_positions``). A cached prefix has no
logits, so its radix-cache match stops at the first of them (``Req.max_prefix_len``, as SGLang caps the prefix at
``logprob_start_len``); the rest is prefilled, in one batch or in chunks, and each prefill batch scores the rows of
its new tokens that fall in that range (``plan_input_logprobs`` before the forward, ``InputLogprobPlan.deliver``
after it). When the prompt is prefilled the request holds every entry (``complete_input_logprobs``) and the first
output delta carries them (``OutputProcessor.make_output``). As SGLang's ``add_input_logprob_return_values``
(srt/managers/scheduler_output_processor_mixin.py), which also accumulates across chunks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.engine.io_struct import TokenLogprob
from radixserve.engine.model.logits import InputLogprobQuery, InputLogprobs
from radixserve.engine.scheduler.request import Req

logger = logging.getLogger(__name__)


@dataclass
class _Segment:
    """``count`` consecutive scored rows of ``req``, from row ``offset`` of the query."""

    req: Req
    offset: int
    count: int


@dataclass
class InputLogprobPlan:
    """The rows of one prefill batch that score prompt tokens, and whose they are.

    Attributes:
        query: what the model runner scores (``ModelRunner.forward_with_input_logprobs``).
        segments: per request with scored rows in this batch, its rows' place in ``query``, in batch order.
    """

    query: InputLogprobQuery
    segments: list[_Segment]

    def deliver(self, result: InputLogprobs) -> None:
        """Append each request's scored tokens (``result``, one row per query row) to its partial list."""
        token_lps = result.token_logprobs.tolist()
        top_ids = result.top_ids.tolist()
        top_lps = result.top_logprobs.tolist()
        targets = self.query.targets.tolist()
        for seg in self.segments:
            k = seg.req.top_logprobs_num
            for r in range(seg.offset, seg.offset + seg.count):
                top = list(zip(top_ids[r][:k], top_lps[r][:k])) if k else []
                seg.req.input_logprobs_partial.append(TokenLogprob(targets[r], token_lps[r], top))


def plan_input_logprobs(batch: Sequence[Req]) -> InputLogprobPlan | None:
    """The scored rows of a prefill batch about to run (each request's ``kv_len`` / ``extend_len`` describe its
    chunk: tokens ``fill_ids[kv_len : kv_len + extend_len]`` are rows ``offset ..`` of the batch's new tokens, in
    batch order); None when no request in it wants prompt logprobs for these tokens.

    A request whose chunk starts past the next position it has to score (its prefix match was not capped: a
    scheduler bug) cannot get them any more: logged as an error, it goes on without prompt logprobs (its deltas
    carry none) rather than taking the scheduler loop, and every other request, down.
    """
    rows: list[int] = []
    targets: list[int] = []
    segments: list[_Segment] = []
    top_k = 0
    offset = 0
    for req in batch:
        if req.wants_input_logprobs:
            wanted = req.input_logprob_positions()
            next_pos = wanted.start + len(req.input_logprobs_partial)  # the next position to score
            if req.kv_len > next_pos and next_pos < wanted.stop:
                logger.error("%s: prompt logprobs from position %d lost (prefill at %d)", req, next_pos, req.kv_len)
                req.logprob_start_len, req.input_logprobs_partial = None, []
            else:
                first = max(next_pos, req.kv_len)
                last = min(wanted.stop, req.kv_len + req.extend_len)  # exclusive
                if first < last:
                    segments.append(_Segment(req, len(rows), last - first))
                    rows.extend(range(offset + first - req.kv_len, offset + last - req.kv_len))
                    targets.extend(req.origin_input_ids[first + 1 : last + 1])
                    top_k = max(top_k, req.top_logprobs_num)
        offset += req.extend_len
    if not rows:
        return None
    query = InputLogprobQuery(
        rows=torch.tensor(rows, dtype=torch.int64),
        targets=torch.tensor(targets, dtype=torch.int64),
        top_k=top_k,
    )
    return InputLogprobPlan(query, segments)


def complete_input_logprobs(req: Req) -> None:
    """After a prefill batch: once ``req``'s prompt is prefilled, move its scored tokens into ``req.input_logprobs``
    (one entry per position ``logprob_start_len .. prompt_len - 1``, None for position 0)."""
    if not req.wants_input_logprobs or req.kv_len < len(req.origin_input_ids):
        return
    assert req.logprob_start_len is not None
    entries: list[TokenLogprob | None] = [None] if req.logprob_start_len == 0 else []
    entries.extend(req.input_logprobs_partial)
    assert len(entries) == len(req.origin_input_ids) - req.logprob_start_len, "every prompt position was scored"
    req.input_logprobs = entries
    req.input_logprobs_partial = []
