"""The sampling phase of a step: one batched ``sample`` over the rows that need a token, with the grammar token
masks of constrained rows filled before it and each constrained row's token accepted by its matcher after it.

Grammar work (bitmask fill, apply, accept) is timed for ``GrammarTiming`` (bench/constrained.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from radixserve.engine.io_struct import TokenLogprob
from radixserve.engine.sampling.sampler import apply_token_bitmask, sample
from radixserve.engine.scheduler.request import Req

logger = logging.getLogger(__name__)


@dataclass
class SampledTokens:
    """One token per row of a sampling step.

    Attributes:
        token_ids: the chosen token of each row.
        logprobs: per row a ``TokenLogprob``, or None where the request did not ask for logprobs.
        rejected: per row, True when the row's grammar matcher rejected its token: the sample must fail rather
            than go on unconstrained.
        grammar_done: per row, True when the grammar accepted the token and terminated.
        dead_end: per row, True when the grammar allowed no token at all, not even a stop token (the client's
            constraint matches no string that starts with the output so far, e.g. the regex ``a[^\\s\\S]``); such
            a row is also ``rejected``. A rejected row that is not a dead end is our bug.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    rejected: list[bool]
    grammar_done: list[bool]
    dead_end: list[bool]


class BatchSampler:
    """Samples the next token of every row; owns the reusable grammar bitmask.

    Args:
        vocab_size: a callable giving the model's vocabulary size (read only when a constrained row appears, so a
            stub runner without a model config works for unconstrained tests).
        max_rows: rows the bitmask is first sized for (it grows when a batch is larger).
        eos_token_ids: the model's end tokens, masked out (with the row's ``stop_token_ids``) of a row that has
            generated fewer than its ``min_new_tokens`` and has no grammar (a grammar ends where it ends).
    """

    def __init__(self, vocab_size: Callable[[], int], max_rows: int, eos_token_ids: Collection[int] = ()):
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.eos_token_ids = sorted(eos_token_ids)  # banned below a request's min_new_tokens
        self.grammar_s = 0.0  # grammar seconds of the last ``sample`` call
        self._token_bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, CPU, reused

    def sample(self, logits: torch.Tensor, reqs: Sequence[Req]) -> SampledTokens:
        """Sample one token per row of ``logits`` (float ``[len(reqs), vocab]``, modified in place) for ``reqs``."""
        self.grammar_s = 0.0
        out = sample(
            logits.float(),
            [r.params for r in reqs],
            [r.output_ids for r in reqs],
            [r.origin_input_ids for r in reqs],
            [r.generator for r in reqs],
            [r.return_logprob for r in reqs],
            [r.top_logprobs_num for r in reqs],
            logits_processor=self._logits_processor(reqs),
        )
        n = len(reqs)
        rejected, done, dead_end = [False] * n, [False] * n, [False] * n
        t0 = time.perf_counter()
        constrained = False
        for i, req in enumerate(reqs):
            if req.matcher is None:
                continue
            constrained = True
            tok = out.next_token_ids[i]
            if req.matcher.accept_token(tok):
                done[i] = req.matcher.is_terminated()
            else:
                rejected[i] = True
                # The mask filled for this step is still in place: an all-zero row left nothing to choose from.
                assert self._token_bitmask is not None
                dead_end[i] = not bool(self._token_bitmask[i].any())
                if not dead_end[i]:
                    logger.error("grammar rejected token %d of %s", tok, req)
        if constrained:
            self.grammar_s += time.perf_counter() - t0
        return SampledTokens(out.next_token_ids, out.logprobs, rejected, done, dead_end)

    def _logits_processor(self, reqs: Sequence[Req]) -> Callable[[torch.Tensor], None] | None:
        """The grammar mask and the ``min_new_tokens`` ban of ``reqs``' rows, applied after the raw logprobs are
        taken (they stay those of the model's distribution); None when no row needs either."""
        grammar = self._grammar_mask(reqs)
        banned = self._min_tokens_ban(reqs)
        if banned is None:
            return grammar

        def apply(logits: torch.Tensor) -> None:
            if grammar is not None:
                grammar(logits)
            logits.index_put_(banned, torch.tensor(float("-inf"), dtype=logits.dtype))

        return apply

    def _min_tokens_ban(self, reqs: Sequence[Req]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(row indices, token ids)`` to set to -inf: the end tokens of each unconstrained row still short of its
        ``min_new_tokens`` (vLLM's min_tokens logits processor); None when there is none."""
        rows: list[int] = []
        toks: list[int] = []
        for i, r in enumerate(reqs):
            if r.params.min_new_tokens > len(r.output_ids) and r.matcher is None:
                ends = set(self.eos_token_ids) | set(r.params.stop_token_ids)
                rows += [i] * len(ends)
                toks += sorted(ends)
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.long), torch.tensor(toks, dtype=torch.long)

    def _grammar_mask(self, reqs: Sequence[Req]) -> Callable[[torch.Tensor], None] | None:
        """Fill the token bitmask of the constrained rows of ``reqs``; returns the logits processor applying it."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not rows:
            return None
        t0 = time.perf_counter()
        words = (self.vocab_size() + 31) // 32
        if self._token_bitmask is None or self._token_bitmask.shape[0] < len(reqs):
            self._token_bitmask = torch.full((max(len(reqs), self.max_rows), words), -1, dtype=torch.int32)
        bitmask = self._token_bitmask
        for i in rows:
            reqs[i].matcher.fill_next_token_bitmask(bitmask, i)
        self.grammar_s += time.perf_counter() - t0

        def apply(logits: torch.Tensor) -> None:
            t1 = time.perf_counter()
            apply_token_bitmask(logits, bitmask, rows)
            self.grammar_s += time.perf_counter() - t1

        return apply
