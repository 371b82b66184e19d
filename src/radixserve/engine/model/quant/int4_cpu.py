"""torch's CPU weight-only int4 GEMM: packing an ``Int4Affine`` for it, and the matmul.

The kernel is ATen's ``_weight_int4pack_mm_for_cpu`` (``aten/src/ATen/native/cpu/int4mm_kernel.cpp``, the CPU port of
gpt-fast's tinygemm): ``y = x @ W.T`` with ``W[n, k] = (q[n, k] - 8) * scale[k // g, n] + zero[k // g, n]``, the scale
and zero stored as ``qScaleAndZeros`` ``[K / g, N, 2]`` in the activation's dtype, dequantized and accumulated in
float32 (AVX-512 / AVX2 paths; blocks of 4 rows by 64 columns, each row summed over K in order, so a row's result does
not depend on the other rows: the kernel is batch invariant as it is). The codes are packed by
``_convert_weight_to_int4pack_for_cpu`` (``[N, K]`` int32 -> ``[N, K / 2]`` uint8, interleaved for the CPU's vector
width: the packed bytes are only valid on the machine, and torch build, that packed them). N must be a multiple of 16.

``torch.compile`` can trace the ATen op (it has a meta function; inductor lowers it to the same kernel,
``torch/_inductor/quantized_lowerings.py``, a C++ template only under max-autotune); the engine calls it through the
``radixserve::int4_linear`` custom op, which also takes the prefill-sized calls to the dense GEMM (``DEQUANT_ROWS``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.engine.model.quant.affine import GROUP, Int4Affine

N_MULTIPLE = 16  # the packing's N block (``_convert_weight_to_int4pack_cpu``: "expect N to be dividable by 16")


# Above this many rows a call dequantizes the weight to the activation dtype (eager torch ops, ~5 ms for 576 x 1536)
# and runs the dense GEMM (oneDNN, AMX where the CPU has it): the kernel dequantizes the weight again for every 4 rows,
# so it is 6-8x slower than the prepacked bfloat16 GEMM from 64 rows on, while at 512 rows the dequantize + GEMM is
# 3-6x (bench/quant_kernels.py, Xeon with AMX, 1 thread: q4-bf16 vs q4-hybrid). 64: about where the two cross.
DEQUANT_ROWS = 64


@dataclass(frozen=True)
class Int4Packed:
    """A weight packed for ``int4_linear``: ``weight`` uint8 ``[N, C * K / 2]`` in the kernel's layout, ``codes``
    uint8 ``[N, C * K / 2]`` the same codes two per byte in plain order (code ``2 j`` in the low nibble of byte ``j``,
    for ``dequantize_codes``), ``scale_zeros`` ``[C * K / 32, N, 2]`` in the activation dtype, ``input_copies`` ``C``
    (``Int4Affine``)."""

    weight: torch.Tensor
    codes: torch.Tensor
    scale_zeros: torch.Tensor
    input_copies: int

    @property
    def out_features(self) -> int:
        """``N``."""
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        """``K``."""
        return int(self.weight.shape[1]) * 2 // self.input_copies

    def nbytes(self) -> int:
        """Bytes of the packed codes (both layouts) and the scales."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.codes, self.scale_zeros))


def int4_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where the kernel runs: CPU, activations float32 / bfloat16 / float16 (only bfloat16 has a vectorized
    kernel on x86; float32 and float16 run a scalar loop, 10-100x slower)."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)


def pack(w: Int4Affine, dtype: torch.dtype) -> Int4Packed:
    """Pack ``w`` for activations of ``dtype``; the scale and zero are rounded once, float64 -> ``dtype`` (exact for
    Q4_0 / Q8_0 in float32 and float16, and for Q4_1's scale; within one rounding of ``dtype`` otherwise).

    Raises ValueError when N is not a multiple of 16 (the caller keeps such a weight dense).
    """
    if w.out_features % N_MULTIPLE:
        raise ValueError(f"the CPU int4 kernel needs N divisible by {N_MULTIPLE}, got N = {w.out_features}")
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32).contiguous(), 1)
    codes = (w.codes[:, 0::2] | (w.codes[:, 1::2] << 4)).contiguous()
    scale_zeros = torch.stack([w.scale, w.zero], dim=-1).to(dtype).transpose(0, 1).contiguous()
    return Int4Packed(weight, codes, scale_zeros, w.input_copies)


def dequantize_codes(
    codes: torch.Tensor, scale_zeros: torch.Tensor, input_copies: int, dtype: torch.dtype
) -> torch.Tensor:
    """The weight ``[N, K]`` of an ``Int4Packed`` (its ``codes`` and ``scale_zeros``) in ``dtype``: the kernel's
    ``(q - 8) * scale + zero`` in float32, the input copies summed, then rounded to ``dtype``."""
    n = codes.shape[0]
    q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(n, -1, GROUP).float()
    sz = scale_zeros.float().transpose(0, 1)  # [N, groups, 2]
    w = torch.addcmul(sz[..., 1:], q - 8, sz[..., :1]).reshape(n, input_copies, -1)
    return (w[:, 0] if input_copies == 1 else w.sum(1)).to(dtype)


def int4_mm(x: torch.Tensor, weight: torch.Tensor, scale_zeros: torch.Tensor, input_copies: int) -> torch.Tensor:
    """The kernel alone: ``x @ W.T``, ``x`` ``[T, K]`` (the dtype of ``scale_zeros``) -> ``[T, N]``, whatever ``T``.

    Raises RuntimeError (from the kernel) on a dtype or shape mismatch.
    """
    if input_copies > 1:
        x = x.repeat(1, input_copies)
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), weight, GROUP, scale_zeros)
    return out


@torch.library.custom_op("radixserve::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    codes: torch.Tensor,
    scale_zeros: torch.Tensor,
    input_copies: int,
    dequant_rows: int = DEQUANT_ROWS,
) -> torch.Tensor:
    """``x @ W.T`` for a packed ``W`` ``[N, K]`` (an ``Int4Packed``'s tensors): ``x`` ``[T, K]`` -> ``[T, N]``; the int4
    kernel up to ``dequant_rows`` rows, above them the dequantized weight through ``F.linear`` (``-1``: always the
    kernel, which is batch invariant: ``--enable-deterministic-inference``).

    One custom op, so ``torch.compile`` keeps the choice (the row count is symbolic there) and compiled rows equal
    eager rows. Raises RuntimeError on a dtype or shape mismatch.
    """
    if 0 <= dequant_rows < x.shape[0]:
        return F.linear(x, dequantize_codes(codes, scale_zeros, input_copies, x.dtype))
    return int4_mm(x, weight, scale_zeros, input_copies)


@int4_linear.register_fake
def _int4_linear_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    codes: torch.Tensor,
    scale_zeros: torch.Tensor,
    input_copies: int,
    dequant_rows: int = DEQUANT_ROWS,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))
