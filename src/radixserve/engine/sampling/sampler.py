"""Batched next-token sampling: penalties, temperature, top-k / top-p / min-p, seeded draws and logprobs.

Semantics follow vLLM / SGLang / the OpenAI API:

- logprobs and top logprobs are ``log_softmax`` of the *raw* model logits (before penalties and temperature);
- ``repetition_penalty`` is HF's (``RepetitionPenaltyLogitsProcessor``): a seen token's logit is divided by the
  penalty when positive and multiplied when negative; "seen" covers prompt + output;
- ``presence_penalty`` subtracts the penalty once per distinct token seen in the output, ``frequency_penalty``
  subtracts ``count * penalty`` (OpenAI's definition);
- ``logit_bias`` (OpenAI's) is added to the logits after the penalties, before greedy choice or temperature; its
  bounds, -100 and 100, are ``±LOGIT_BIAS_HARD`` (io_struct): a ban and an exclusive choice, which a grammar's
  ``-inf`` mask still overrides. Logprobs stay those of the raw logits (as vLLM's default ``raw_logprobs``);
- temperature below ``GREEDY_TEMPERATURE`` is greedy argmax (after penalties); otherwise the logits are divided by the
  temperature, then top-k, top-p (on the renormalised distribution, as vLLM's ``apply_top_k_top_p``) and min-p
  (relative to the max probability, as SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch``) filter them.

The draw is inverse-CDF sampling (``searchsorted(cumsum(probs), u * sum(probs))``, what ``torch.multinomial`` does for
one sample) with one uniform per row: unlike vLLM's exponential race (``argmax(probs / Exponential(1))``) it needs no
full-vocab noise tensor, which dominates sampling time on CPU; unlike ``torch.multinomial`` it never raises on a row
of zeros or NaN. A seeded row draws its uniform from its own ``torch.Generator``, so its token does not depend on the
rest of the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.engine.io_struct import SamplingParams, TokenLogprob

# Temperatures below this are treated as greedy (SGLang's and vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SampleOutput:
    """Result of one sampling step.

    ``next_token_ids``: ``[batch]`` chosen token ids. ``logprobs``: per row a ``TokenLogprob`` (raw-distribution logprob
    of the chosen token plus the ``top_logprobs_num`` best alternatives, sorted descending), or None where the row did
    not ask for logprobs.
    """

    next_token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_ids: list[list[int]],
    prompt_ids: list[list[int]],
    generators: list[torch.Generator | None],
    return_logprob: list[bool],
    top_logprobs_num: list[int],
    logits_processor: Callable[[torch.Tensor], None] | None = None,
) -> SampleOutput:
    """Pick one next token per row.

    Args:
        logits: ``[batch, vocab]`` raw model logits (float32; other dtypes are upcast). Modified in place.
        params: per-row ``SamplingParams`` (only the sampling fields are read; ranges are assumed validated).
        output_ids: per-row tokens generated so far (presence / frequency / repetition penalties).
        prompt_ids: per-row prompt tokens (repetition penalty covers prompt + output, as HF).
        generators: per-row ``torch.Generator`` on ``logits.device`` for seeded requests; None uses the global RNG.
        return_logprob: per-row flag; rows with False get ``None`` in ``SampleOutput.logprobs``.
        top_logprobs_num: per-row number of top alternatives to report (0 for none).
        logits_processor: called once on the float32 ``[batch, vocab]`` logits (in place) after the raw logprobs are
            taken and before penalties, e.g. a grammar's token mask (``apply_token_bitmask``).

    Returns:
        ``SampleOutput`` with ``batch`` token ids.

    Raises:
        ValueError: when the per-row lists do not all have ``batch`` entries or ``logits`` is not 2-D.

    Rows whose logits are all ``-inf`` / NaN never crash: they fall back to the argmax of their (NaN-free) logits.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    for name, seq in (
        ("params", params),
        ("output_ids", output_ids),
        ("prompt_ids", prompt_ids),
        ("generators", generators),
        ("return_logprob", return_logprob),
        ("top_logprobs_num", top_logprobs_num),
    ):
        if len(seq) != batch:
            raise ValueError(f"{name} has {len(seq)} entries for a batch of {batch}")
    if batch == 0:
        return SampleOutput([], [])
    if logits.dtype != torch.float32:
        logits = logits.float()

    # Logprobs come from the raw distribution, so take them before anything edits the logits.
    lp_rows = [i for i in range(batch) if return_logprob[i]]
    raw_logprobs = None
    if lp_rows:
        src = logits if len(lp_rows) == batch else logits[lp_rows]
        raw_logprobs = torch.log_softmax(src, dim=-1)  # [len(lp_rows), vocab], a new tensor

    if logits_processor is not None:
        logits_processor(logits)
    apply_penalties(logits, params, output_ids, prompt_ids)
    apply_logit_bias(logits, params)

    greedy_rows = [i for i, p in enumerate(params) if p.temperature < GREEDY_TEMPERATURE or p.top_k == 1]
    sample_rows = [i for i, p in enumerate(params) if not (p.temperature < GREEDY_TEMPERATURE or p.top_k == 1)]

    next_ids = torch.empty(batch, dtype=torch.long, device=logits.device)
    if greedy_rows:
        if len(greedy_rows) == batch:
            next_ids = torch.argmax(logits, dim=-1)
        else:
            next_ids[greedy_rows] = torch.argmax(logits[greedy_rows], dim=-1)
    if sample_rows:
        next_ids[sample_rows] = _sample_rows(logits, sample_rows, params, generators)

    ids_list: list[int] = next_ids.tolist()
    logprobs: list[TokenLogprob | None] = [None] * batch
    if raw_logprobs is not None:
        logprobs = _gather_logprobs(raw_logprobs, lp_rows, next_ids, top_logprobs_num, batch)
    return SampleOutput(next_token_ids=ids_list, logprobs=logprobs)


def _flat_index(
    rows: list[int], token_lists: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists into ``(row_index, token_index)``, each ``[total_tokens]`` int64."""
    lengths = [len(t) for t in token_lists]
    row_idx = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), torch.tensor(lengths, dtype=torch.long))
    tok_idx = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    return row_idx.to(device), tok_idx.to(device)


def _per_token(
    values: list[float], token_lists: list[list[int]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[sum(len(t) for t in token_lists)]``: ``values[i]`` repeated once per entry of ``token_lists[i]``."""
    v = torch.tensor(values, dtype=dtype)
    return torch.repeat_interleave(v, torch.tensor([len(t) for t in token_lists])).to(device)


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], output_ids: list[list[int]], prompt_ids: list[list[int]]
) -> None:
    """Apply repetition, presence and frequency penalties in place on ``logits`` ``[batch, vocab]`` (float).

    ``params``, ``output_ids``, ``prompt_ids`` are per row, as in ``sample``. Token ids must lie in ``[0, vocab)``
    (an out-of-range id raises ``IndexError`` from torch).

    Sparse: only rows with a penalty and only their seen token ids are touched (gather / index_put), so the cost is
    proportional to the number of seen tokens, never a dense ``[batch, vocab]`` count tensor.
    Order as vLLM's ``apply_penalties``: repetition first, then presence and frequency.
    """
    device = logits.device
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and (prompt_ids[i] or output_ids[i])]
    if rep_rows:
        seen = [prompt_ids[i] + output_ids[i] for i in rep_rows]
        row_idx, tok_idx = _flat_index(rep_rows, seen, device)
        penalty = _per_token([params[i].repetition_penalty for i in rep_rows], seen, logits.dtype, device)
        vals = logits[row_idx, tok_idx]
        # A token seen twice gets the same value written twice (non-accumulating put): penalised once, as HF.
        logits[row_idx, tok_idx] = torch.where(vals > 0, vals / penalty, vals * penalty)

    pres_rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 and output_ids[i]]
    if pres_rows:
        outs = [output_ids[i] for i in pres_rows]
        row_idx, tok_idx = _flat_index(pres_rows, outs, device)
        pres = _per_token([params[i].presence_penalty for i in pres_rows], outs, logits.dtype, device)
        logits[row_idx, tok_idx] = logits[row_idx, tok_idx] - pres  # once per distinct token

    freq_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 and output_ids[i]]
    if freq_rows:
        outs = [output_ids[i] for i in freq_rows]
        row_idx, tok_idx = _flat_index(freq_rows, outs, device)
        freq = _per_token([params[i].frequency_penalty for i in freq_rows], outs, logits.dtype, device)
        # accumulate=True sums duplicates: each occurrence subtracts the penalty once -> count * penalty.
        logits.index_put_((row_idx, tok_idx), -freq, accumulate=True)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Add each row's ``logit_bias`` to ``logits`` ``[batch, vocab]`` (float) in place.

    Sparse, like the penalties: one ``index_put_`` over the biased rows' entries only, and nothing at all (not even a
    tensor) when no row has a bias. Token ids are assumed validated below ``vocab`` (``SamplingParams.validate``).
    """
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return
    entries = [params[i].bias_entries() for i in rows]
    row_idx, tok_idx = _flat_index(rows, [ids for ids, _ in entries], logits.device)
    bias = torch.tensor([b for _, biases in entries for b in biases], dtype=logits.dtype, device=logits.device)
    logits.index_put_((row_idx, tok_idx), bias, accumulate=True)


# top-p first looks at this many best tokens; only rows whose nucleus is wider fall back to a full sort (a full sort of
# [64, 49152] costs ~100-200 ms on 2 CPU cores, a top-1024 ~10 ms, and LLM nuclei are usually far narrower).
TOP_P_CANDIDATES = 1024


def _sample_rows(
    logits: torch.Tensor, rows: list[int], params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Sample one token for each of ``rows``; returns ``[len(rows)]`` int64 token ids.

    Temperature, then top-k / top-p / min-p filtering (whole-tensor masks with per-row thresholds; only top-p rows
    sort), then an inverse-CDF draw whose uniform comes from the row's own generator for seeded rows.
    """
    device = logits.device
    n = len(rows)
    vocab = logits.shape[1]
    x = logits if n == logits.shape[0] else logits[rows]  # [n, vocab]; in place when every row samples
    temps = torch.tensor([params[i].temperature for i in rows], dtype=x.dtype, device=device)
    x.div_(temps.unsqueeze(1))

    # top-k: mask logits below each row's k-th largest value (ties at the k-th value are kept, as vLLM).
    ks = [params[i].top_k if 0 < params[i].top_k < vocab else 0 for i in rows]
    if any(ks):
        k_max = max(ks)
        top_vals = torch.topk(x, k_max, dim=-1).values  # [n, k_max], descending
        k_idx = torch.tensor([max(k, 1) - 1 for k in ks], dtype=torch.long, device=device)
        kth = top_vals.gather(1, k_idx.unsqueeze(1))
        disabled = torch.tensor([k == 0 for k in ks], device=device).unsqueeze(1)
        kth.masked_fill_(disabled, float("-inf"))
        x.masked_fill_(x < kth, float("-inf"))

    probs = torch.softmax(x, dim=-1)  # [n, vocab]

    p_local = [j for j, i in enumerate(rows) if params[i].top_p < 1.0]
    if p_local:
        _apply_top_p(probs, p_local, [params[rows[j]].top_p for j in p_local])

    min_ps = [params[i].min_p for i in rows]
    if any(m > 0.0 for m in min_ps):
        # min-p: drop tokens below min_p * (max prob); the ratio is unaffected by top-k/top-p renormalisation.
        scale = torch.tensor(min_ps, dtype=probs.dtype, device=device).unsqueeze(1)
        thresh = probs.max(dim=-1, keepdim=True).values * scale
        probs.masked_fill_(probs < thresh, 0.0)

    # Inverse-CDF draw: the first token whose cumulative mass exceeds u * total, u ~ U[0, 1). One uniform per row (a
    # full-vocab noise tensor, as the exponential race needs, costs 3-5x more on CPU). float64 keeps the CDF exact
    # enough that tokens far below 1e-7 of the mass keep their share. Zero-probability tokens have an empty CDF
    # interval, so they are never drawn; filtered probs need no renormalisation.
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # [n, vocab]
    total = cdf[:, -1:]
    u = torch.empty(n, 1, dtype=torch.float64, device=device)
    seeded = [j for j, i in enumerate(rows) if generators[i] is not None]
    if len(seeded) < n:
        u.uniform_()
    for j in seeded:
        u[j].uniform_(generator=generators[rows[j]])
    # u * total can round up to total; stay strictly below it so some token's interval contains the target.
    target = torch.minimum(u * total, total * (1.0 - 2.0**-50))
    chosen = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)

    # Rows whose logits were all -inf / NaN (or held +inf) have a NaN or zero total; they fall back to a NaN-free
    # argmax of the logits.
    bad = ~(total.squeeze(1) > 0) | ~torch.isfinite(total.squeeze(1))
    if bool(bad.any()):
        bad_local = bad.nonzero().flatten()
        clean = torch.nan_to_num(logits[[rows[j] for j in bad_local.tolist()]], nan=float("-inf"))
        chosen[bad_local] = torch.argmax(clean, dim=-1)
    return chosen


def _apply_top_p(probs: torch.Tensor, rows: list[int], top_ps: list[float]) -> None:
    """Zero, in place, the tokens outside each row's nucleus in ``probs`` ``[n, vocab]`` (rows: local indices).

    A token is kept while the probability mass strictly before it (in descending order) is below ``top_p``, so the
    argmax always stays. Implemented as a per-row probability threshold found from a top-``TOP_P_CANDIDATES``
    partial sort, with a full sort only for rows whose nucleus is wider.
    """
    device = probs.device
    every_row = len(rows) == probs.shape[0]
    sub = probs if every_row else probs[rows]  # [m, vocab]
    p = torch.tensor(top_ps, dtype=probs.dtype, device=device).unsqueeze(1)
    k = min(TOP_P_CANDIDATES, sub.shape[1])
    vals = torch.topk(sub, k, dim=-1).values  # [m, k], descending
    thresh = _nucleus_threshold(vals, p)
    wide = vals.sum(dim=-1) < p.squeeze(1)  # the nucleus reaches beyond the k candidates
    if k < sub.shape[1] and bool(wide.any()):
        wide_idx = wide.nonzero().flatten()
        full = torch.sort(sub[wide_idx], dim=-1, descending=True).values
        thresh[wide_idx] = _nucleus_threshold(full, p[wide_idx])
    if every_row:
        probs.masked_fill_(probs < thresh, 0.0)
    else:
        probs[rows] = sub.masked_fill(sub < thresh, 0.0)


def _nucleus_threshold(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Smallest kept probability ``[m, 1]`` given descending ``sorted_probs`` ``[m, k]`` and ``top_p`` ``[m, 1]``."""
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # non-decreasing, so "kept" is a prefix
    kept = mass_before < top_p
    kept[:, 0] = True
    last = kept.sum(dim=-1, keepdim=True) - 1
    return sorted_probs.gather(1, last)


def _gather_logprobs(
    raw_logprobs: torch.Tensor, lp_rows: list[int], next_ids: torch.Tensor, top_logprobs_num: list[int], batch: int
) -> list[TokenLogprob | None]:
    """Build ``TokenLogprob`` per requested row from ``raw_logprobs`` ``[len(lp_rows), vocab]``."""
    chosen = next_ids[lp_rows]
    chosen_lp = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    chosen_ids = chosen.tolist()
    k_max = min(max(top_logprobs_num[i] for i in lp_rows), raw_logprobs.shape[1])
    top_vals: list[list[float]] = [[] for _ in lp_rows]
    top_ids: list[list[int]] = [[] for _ in lp_rows]
    if k_max > 0:
        vals, idx = torch.topk(raw_logprobs, k_max, dim=-1)  # sorted descending
        top_vals, top_ids = vals.tolist(), idx.tolist()
    out: list[TokenLogprob | None] = [None] * batch
    for j, i in enumerate(lp_rows):
        k = top_logprobs_num[i]
        out[i] = TokenLogprob(
            token_id=chosen_ids[j],
            logprob=chosen_lp[j],
            top=_ties_ordered(list(zip(top_ids[j], top_vals[j])), chosen_ids[j], chosen_lp[j])[:k],
        )
    return out


def _ties_ordered(top: list[tuple[int, float]], chosen: int, chosen_lp: float) -> list[tuple[int, float]]:
    """``top`` (token id, logprob), descending, with equal logprobs ordered by the chosen token first, then by id.

    bf16 logits tie often (the demo model's ``' help'`` and ``' assist'`` after "Hi" on an AMD EPYC), and topk orders
    ties arbitrarily: greedy argmax takes the lowest id, so without this a greedy reply's ``top_logprobs[0]`` could
    name another token than the one returned (regression: tests/test_server_e2e.py, test_chat_logprobs_shapes). A
    chosen token tied with the top but left out by topk is put back in first place."""
    if top and chosen_lp >= top[0][1] and all(t != chosen for t, _ in top):
        top = [(chosen, chosen_lp), *top[:-1]]
    return sorted(top, key=lambda tv: (-tv[1], tv[0] != chosen, tv[0]))


# --------------------------------------------------------------------------------------------------------------------
# grammar token masks

_BIT_OFFSETS = np.arange(32, dtype=np.int64)


def _set_bit_ids(words: np.ndarray) -> np.ndarray:
    """Token ids whose bit is set in ``words`` ``[num_words]`` int32 (bit j of word w is id 32 w + j), sorted."""
    nz = np.flatnonzero(words)
    bits = np.unpackbits(words[nz].view(np.uint8), bitorder="little").view(bool).reshape(len(nz), 32)
    ids: np.ndarray = (nz[:, None] * 32 + _BIT_OFFSETS)[bits]
    return ids


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to ``-inf``, in place, the logits of tokens a grammar forbids.

    Args:
        logits: ``[batch, vocab]`` float logits (CPU: contiguous float32; CUDA: any float dtype).
        bitmask: ``[>= batch, ceil(vocab / 32)]`` int32 on the CPU, xgrammar's layout: bit ``j`` of word ``w`` set
            means token ``32 w + j`` is allowed. Rows not in ``rows`` are ignored.
        rows: the rows of ``logits`` to mask (constrained samples).

    Why not ``xgrammar.apply_token_bitmask_inplace``: on CPU it costs ~250 us per row when nearly every token is
    banned (the usual case inside JSON structure), and a dense unpack + ``masked_fill_`` cost 0.2-4 ms per row on 2
    busy cores. Here each row works on the sparse side: when fewer than half the tokens are allowed, the allowed
    logits are saved, the row filled with ``-inf`` and the saved ones written back; otherwise only the banned ids are
    written. Only the words that are non-zero are unpacked (~10-20 us per row). On CUDA the mask is unpacked with
    bit shifts on the device and applied with one ``masked_fill_``.
    """
    if not rows:
        return
    vocab = logits.shape[1]
    if logits.device.type != "cpu":
        _apply_token_bitmask_dense(logits, bitmask, rows)
        return
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"CPU logits must be contiguous float32, got {logits.dtype}")
    values = logits.numpy()
    masks = bitmask.numpy()
    neg = np.float32(-np.inf)
    for r in rows:
        words = masks[r]
        row = values[r]
        allowed_words = int(np.count_nonzero(words))
        if allowed_words * 2 < len(words):
            keep = _set_bit_ids(words)
            keep = keep[keep < vocab]
            saved = row[keep]
            row.fill(neg)
            row[keep] = saved
        else:
            ban = _set_bit_ids(~words)
            row[ban[ban < vocab]] = neg


def _apply_token_bitmask_dense(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """``apply_token_bitmask`` for accelerators: unpack ``bitmask[rows]`` with bit shifts on ``logits.device`` (one
    ``[len(rows), vocab]`` bool mask) and ``masked_fill_`` the banned tokens. Same arguments and layout."""
    vocab = logits.shape[1]
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    words = bitmask[rows].to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(len(rows), -1)[:, :vocab]
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
