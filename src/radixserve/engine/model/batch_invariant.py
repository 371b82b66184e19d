"""Batch-invariant building blocks for ``--enable-deterministic-inference``: a row's result never depends on the rows
beside it.

Why it is needed: a CPU GEMM ``x @ W.T`` picks its kernel and blocking from the row count ``T``, and with them the
order in which it sums along ``in``. So a sequence's logits change in the last bits when the number of tokens in its
batch changes (max |logit diff| ~4e-5 float32, ~0.1-0.4 bfloat16 for SmolLM2-135M), enough to flip a sampled token
now and then. Measured with torch 2.13 (MKL 2024.2, oneDNN 3.12), 1-300 rows, 1 and 2 threads:

- AMD EPYC Zen 4 (AVX2 sgemm path): float32 ``F.linear`` with 1-11 rows runs MKL's small-M kernels, the last
  ``T mod 4`` rows differ from the 4-row kernel's; bfloat16 was invariant.
- Intel Xeon (AVX-512, avx512_bf16, no AMX): float32 ``F.linear`` gives one result for 2-15 rows and another for 16 or
  more (and a third for 1); oneDNN-prepacked float32 (``prepack.py``) differs at 1 row only, and so did prepacked
  bfloat16 on the real model's down projection (1536 -> 576) for some inputs, enough to change its seeded text.
- Everywhere: a GEMM of a FIXED row count gave every row the same bits whatever its position and the other rows'
  values (dense and prepacked, float32 and bfloat16).

The row reductions the model and the sampler use (RMSNorm's mean, softmax, log-softmax, float64 cumsum, top-k, argmax)
are batch invariant as they are. ``row_invariance_violations`` is the check behind these statements; the tests run it
again on the machine they run on.

The fix follows Thinking Machines' "Defeating Nondeterminism in LLM Inference" (He et al. 2025) and SGLang's
``--enable-deterministic-inference``: give each row one reduction strategy whatever the batch. Here it is the last
point above: every GEMM runs on chunks of exactly ``ROW_CHUNK`` rows (the last chunk zero-padded), so no property of a
particular CPU's kernel selection is relied on. The price: batch-1 decode computes 8 rows (the weights are read once
either way, so it is compute, not bandwidth), and a prefill of ``T`` tokens runs ``T / 8`` GEMM calls per projection
(each projection's weight stays in cache between its chunks); bench/README.md has the measured cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

# Every batch-invariant GEMM runs on exactly this many rows (module docstring); oneDNN's packing hint is the same.
ROW_CHUNK = 8


def in_row_chunks(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, out_features: int) -> torch.Tensor:
    """``gemm(x)`` computed ``ROW_CHUNK`` rows at a time, so row ``i`` depends only on ``x[i]`` (bitwise).

    Args:
        gemm: maps ``[ROW_CHUNK, in]`` to ``[ROW_CHUNK, out_features]`` row by row (a projection).
        x: ``[T, in]`` activations (``T`` may be 0).
        out_features: the output width.

    Returns:
        ``[T, out_features]`` in ``x``'s dtype.
    """
    T = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -T % ROW_CHUNK))
    out = x.new_empty((padded.shape[0], out_features))
    for start in range(0, padded.shape[0], ROW_CHUNK):
        out[start : start + ROW_CHUNK] = gemm(padded[start : start + ROW_CHUNK])
    return out[:T]


@torch.library.custom_op("radixserve::batch_invariant_linear", mutates_args=())
def _batch_invariant_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return in_row_chunks(lambda rows: F.linear(rows, weight, bias), x, weight.shape[0])


@_batch_invariant_linear_op.register_fake
def _batch_invariant_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose row ``i`` depends only on ``x[i]`` (bitwise), whatever the number of rows.

    Args:
        x: ``[T, in]`` activations (2-D; ``T`` may be 0).
        weight: ``[out, in]``.
        bias: ``[out]`` or None.

    Returns:
        ``[T, out]`` in ``x``'s dtype: ``F.linear`` over chunks of ``ROW_CHUNK`` rows (``in_row_chunks``). One custom
        op, so ``torch.compile`` keeps the chunk loop (its token count is symbolic) and compiled rows equal eager rows.

    Raises:
        ValueError: ``x`` is not 2-D.

    Invariance is a measured property of the CPU GEMM libraries (module docstring), not a guarantee on other devices.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, features], got shape {tuple(x.shape)}")
    out: torch.Tensor = _batch_invariant_linear_op(x, weight, bias)
    return out


def row_invariance_violations(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    row_counts: Sequence[int],
    offsets: Sequence[int] = (0,),
) -> list[tuple[int, int]]:
    """Where ``fn`` is not batch invariant: ``(offset, T)`` pairs for which ``fn(x[offset:offset+T])`` differs
    bitwise from the same rows of ``fn(x)``.

    Args:
        fn: maps ``[T, ...]`` to ``[T, ...]`` row by row (a projection, a norm, a softmax).
        x: ``[N, ...]`` input rows; ``offset + T <= N`` for every pair tried (larger pairs are skipped).
        row_counts: the batch sizes ``T`` to try.
        offsets: first rows of the slices, so a row is also tried at other positions of its batch.

    Returns:
        The failing pairs, empty when ``fn`` is invariant on these inputs.
    """
    full = fn(x)
    bad = []
    for off in offsets:
        for T in row_counts:
            if off + T <= x.shape[0] and not torch.equal(fn(x[off : off + T]), full[off : off + T]):
                bad.append((off, T))
    return bad
