"""torch's CPU weight-only int8 GEMM and the per-channel quantization it takes (``--torchao-config int8wo``).

The kernel is ATen's ``_weight_int8pack_mm`` (``aten/src/ATen/native/cpu/int8mm_kernel.cpp``): ``y = (x @ q.T) *
scale`` with ``q`` int8 ``[N, K]`` and one ``scale`` per output row ``[N]`` in the activation's dtype (torchao's
``int8_weight_only`` layout on CPU). It computes each row on its own (checked by tests/test_quant_hf.py), so it is
batch invariant as it is. It is fast only for a few rows: measured per 576 -> 1536 call on a Xeon with AMX, 1 thread,
bfloat16: 73 us at 1 row vs 162 us for the dense GEMM, but 387 us at 8, 1.47 ms at 32 and 17.9 ms at 512, while
dequantizing the weight (one cast and one multiply) and running ``F.linear`` costs ~1.1-1.6 ms at any row count up
to 512. Above ``DEQUANT_ROWS`` rows a call therefore dequantizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# About where the kernel and dequantize + dense GEMM cross (32 rows: 1.47 ms vs 1.28 ms, module docstring).
DEQUANT_ROWS = 24


@dataclass(frozen=True)
class Int8Channels:
    """``codes`` int8 ``[N, K]`` in -127..127 and ``scale`` ``[N]`` (the activation dtype): ``W ~ codes * scale``."""

    codes: torch.Tensor
    scale: torch.Tensor

    def nbytes(self) -> int:
        """Bytes of the codes and the scales."""
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * self.scale.element_size()

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[N, K]`` it stands for, ``codes * scale`` rounded once to ``dtype``."""
        return (self.codes.float() * self.scale.float()[:, None]).to(dtype)


def quantize_int8_channels(weight: torch.Tensor, dtype: torch.dtype) -> Int8Channels:
    """Symmetric per-output-channel int8 of ``weight`` ``[N, K]`` (torchao's ``int8_weight_only``): ``scale =
    max |w| / 127`` per row (rounded to ``dtype`` first, so the codes are chosen for the scale the kernel uses),
    ``codes = round(w / scale)``. Each weight is then within ``scale / 2`` of ``codes * scale``; an all-zero row
    gets scale 1 and codes 0."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).to(dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Channels(codes.contiguous(), scale.contiguous())


def int8_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where the kernel runs: CPU, activations float32 / bfloat16 / float16."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16)


@torch.library.custom_op("radixserve::int8_linear", mutates_args=())
def int8_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, dequant_rows: int = DEQUANT_ROWS
) -> torch.Tensor:
    """``x @ W.T`` for ``W = codes * scale`` (an ``Int8Channels``): ``x`` ``[T, K]`` -> ``[T, N]``; the int8 kernel up
    to ``dequant_rows`` rows, above them the dequantized weight through ``F.linear`` (``-1``: always the kernel, which
    is batch invariant: ``--enable-deterministic-inference``).

    One custom op, so ``torch.compile`` keeps the choice (the row count is symbolic there). Raises RuntimeError on a
    dtype or shape mismatch.
    """
    if 0 <= dequant_rows < x.shape[0]:
        return F.linear(x, codes.to(x.dtype) * scale[:, None])
    out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x.contiguous(), codes, scale)
    return out


@int8_linear.register_fake
def _int8_linear_fake(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, dequant_rows: int = DEQUANT_ROWS
) -> torch.Tensor:
    return x.new_empty((x.shape[0], codes.shape[0]))
