"""Batch-invariant building blocks for ``--enable-deterministic-inference``: a row's result never depends on the rows
beside it.

Why it is needed (measured on this project's CPU, an AVX2 AMD EPYC, torch 2.13 with MKL 2024.2 and oneDNN 3.12): a
float32 GEMM ``x @ W.T`` with fewer than 12 rows runs MKL's small-M kernels, whose summation order depends on the row
count: ``T = 1`` is a GEMV, and the last ``T mod 4`` rows of 5-11 differ from the 4-row kernel's. So a sequence's
logits change in the last bits when the number of tokens in its batch changes (max |logit diff| ~4e-5 for
SmolLM2-135M), enough to flip a sampled token now and then. Every row count that is a multiple of 4, or 12 or more,
gave rows bitwise equal to each other (1-2048 rows, 1 and 2 threads, with and without bias). bfloat16 GEMMs (oneDNN,
emulated on this CPU) were row invariant at every row count. The row reductions the model and the sampler use
(RMSNorm's mean, softmax, log-softmax, float64 cumsum, top-k, argmax) are batch invariant as they are.
``row_invariance_violations`` is the check behind these statements; the tests run it again.

The fix follows Thinking Machines' "Defeating Nondeterminism in LLM Inference" (He et al. 2025) and SGLang's
``--enable-deterministic-inference``: give each row one reduction strategy whatever the batch. Here fewer than
``MIN_ROWS`` rows are zero-padded to a multiple of ``ROW_TILE``, so every row goes through the 4-row kernel family.
The price is batch-1 decode: 4 rows cost ~3x a GEMV (one thread); from 4 rows on, nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

# MKL's sgemm gives every row the same summation order for a multiple of ROW_TILE rows, or MIN_ROWS rows or more
# (measured, module docstring).
ROW_TILE = 4
MIN_ROWS = 12


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose row ``i`` depends only on ``x[i]`` (bitwise), whatever the number of rows.

    Args:
        x: ``[T, in]`` activations (2-D; ``T`` may be 0).
        weight: ``[out, in]``.
        bias: ``[out]`` or None.

    Returns:
        ``[T, out]`` in ``x``'s dtype: ``F.linear(x, weight, bias)``, computed on ``x`` zero-padded to a multiple of
        ``ROW_TILE`` rows when ``T < MIN_ROWS`` (one copy of ``x``).

    Raises:
        ValueError: ``x`` is not 2-D.

    Invariance is a measured property of the CPU GEMM libraries (module docstring), not a guarantee on other devices.
    Inside ``torch.compile`` (the token count is an unbacked size, which a graph cannot branch on) every row count is
    padded to a multiple of ``ROW_TILE``: the same kernel family, so compiled and eager rows agree.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, features], got shape {tuple(x.shape)}")
    T = x.shape[0]
    if not torch.compiler.is_compiling() and (T >= MIN_ROWS or T % ROW_TILE == 0):
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, -T % ROW_TILE)), weight, bias)[:T]


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
