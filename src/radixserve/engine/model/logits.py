"""Prompt-token logprobs from final hidden states: the LM head and log-softmax over a bounded number of rows at a time.

A prefill computes the hidden state of every new token anyway; scoring prompt tokens only adds the LM head and a
log-softmax over the rows asked for (SGLang's ``LogitsProcessor`` input logprobs, srt/layers/logits_processor.py).
Those are ``[rows, vocab]`` float32 (vocabulary 49152: 192 KiB per row), so they run ``INPUT_LOGPROB_CHUNK_ROWS``
rows at a time and keep only each row's target logprob and top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Rows per LM head + log-softmax chunk: 128 rows x 49152 x 4 B = 24 MiB of float32 logits, normalised in place.
INPUT_LOGPROB_CHUNK_ROWS = 128


@dataclass
class InputLogprobQuery:
    """Which new tokens of an EXTEND batch are scored, and against which following token.

    Attributes:
        rows: int64 ``[R]``, rows of ``ForwardBatch.input_ids`` whose next-token distribution is wanted.
        targets: int64 ``[R]``, the token scored at each row (the prompt token that follows it).
        top_k: alternatives reported per row (0: none).
    """

    rows: torch.Tensor
    targets: torch.Tensor
    top_k: int = 0


@dataclass
class InputLogprobs:
    """Scores of an ``InputLogprobQuery``, on the CPU, natural-log probabilities of the raw logits.

    Attributes:
        token_logprobs: float32 ``[R]``, logprob of ``targets[i]`` at row ``rows[i]``.
        top_ids: int64 ``[R, top_k]``, the ``top_k`` most likely tokens of each row, most likely first.
        top_logprobs: float32 ``[R, top_k]``, their logprobs.
    """

    token_logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def score_hidden_states(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    top_k: int,
    chunk_rows: int = INPUT_LOGPROB_CHUNK_ROWS,
) -> InputLogprobs:
    """Logprob of each row's target token (and the row's top ``top_k``) under ``log_softmax(compute_logits(row))``.

    Args:
        hidden: ``[R, hidden_size]`` final hidden states (after the final norm), model dtype, on the model's device.
        compute_logits: the LM head, ``[r, hidden_size]`` -> float32 ``[r, vocab]``
            (``LlamaForCausalLM.compute_logits``).
        targets: int64 ``[R]`` token ids to score (any device).
        top_k: alternatives per row (0: none; at most the vocabulary).
        chunk_rows: rows per LM head call: peak extra memory is ``chunk_rows x vocab x 4`` bytes.
    Returns:
        ``InputLogprobs`` on the CPU.
    """
    n = hidden.shape[0]
    targets = targets.to(hidden.device)
    token_lps: list[torch.Tensor] = []
    top_vals: list[torch.Tensor] = []
    top_idx: list[torch.Tensor] = []
    for start in range(0, n, chunk_rows):
        logits = compute_logits(hidden[start : start + chunk_rows])  # float32 [r, vocab], a new tensor
        logits.sub_(torch.logsumexp(logits, dim=-1, keepdim=True))  # log_softmax in place
        token_lps.append(logits.gather(1, targets[start : start + chunk_rows, None]).squeeze(1))
        if top_k > 0:
            vals, idx = torch.topk(logits, min(top_k, logits.shape[1]), dim=-1)  # sorted, descending
            top_vals.append(vals)
            top_idx.append(idx)
    return InputLogprobs(
        token_logprobs=torch.cat(token_lps).cpu() if token_lps else torch.empty(0),
        top_ids=torch.cat(top_idx).cpu() if top_idx else torch.empty((n, 0), dtype=torch.int64),
        top_logprobs=torch.cat(top_vals).cpu() if top_vals else torch.empty((n, 0)),
    )
