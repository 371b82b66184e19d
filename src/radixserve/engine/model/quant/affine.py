"""``Int4Affine``: a weight as 4-bit codes with one scale and one zero per group of 32 inputs, in the form of torch's
CPU int4 kernel (tinygemm's): ``w = (q - 8) * scale + zero``.

Each GGML type maps onto it exactly (the scales are kept in float64 until packing, so the only rounding is the one
to the kernel's scale dtype, ``int4_cpu.pack``):

- Q4_0 ``w = (q - 8) * d``: ``scale = d``, ``zero = 0``.
- Q4_1 ``w = q * d + m``: ``scale = d``, ``zero = m + 8 d``.
- Q8_0 ``w = q * d`` (``q`` int8): 8 bits do not fit 4, so the codes are split, ``q + 128 = 16 h + l`` with
  ``h, l`` in 0..15, into two int4 halves along K: ``(h - 8) * 16 d`` (``zero = 0``) plus ``(l - 8) * d + 8 d``
  (``zero = 8 d``), whose sum is ``d (16 h + l - 128) = q d``. The kernel then runs over ``2 K`` inputs with the
  activation given twice (``input_copies = 2``), summing both halves in its float32 accumulator. Bytes: 2 x 16 of
  codes + 2 x 2 scale/zero pairs per 32 weights (40 in bfloat16, vs 34 for Q8_0 and 64 for bfloat16).

Row permutation (``rows``) and concatenation along N (``cat``, the fused q/k/v and gate/up projections) move whole
rows with their scales, so they are exact too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

GROUP = 32  # inputs per scale/zero group: the GGML block size


@dataclass(frozen=True)
class Int4Affine:
    """``codes`` uint8 0..15 ``[N, C * K]``; ``scale``, ``zero`` float64 ``[N, C * K / 32]``; ``input_copies`` ``C``.

    The weight ``[N, K]`` it stands for is ``sum over c of ((codes - 8) * scale + zero)[:, c K : (c + 1) K]``, each
    scale and zero repeated over its group of 32 inputs (``dense``).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    input_copies: int = 1

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if (
            k % (GROUP * self.input_copies)
            or self.scale.shape != (n, k // GROUP)
            or self.zero.shape != self.scale.shape
        ):
            raise ValueError(
                f"codes {tuple(self.codes.shape)}, scale {tuple(self.scale.shape)}, zero {tuple(self.zero.shape)} "
                f"do not form groups of {GROUP} with {self.input_copies} input copies"
            )

    @property
    def out_features(self) -> int:
        """``N``."""
        return int(self.codes.shape[0])

    @property
    def in_features(self) -> int:
        """``K``, the width of the activations (the codes hold ``input_copies`` times as many columns)."""
        return int(self.codes.shape[1]) // self.input_copies

    @classmethod
    def from_q4_0(cls, codes: torch.Tensor, d: torch.Tensor) -> Int4Affine:
        """From ``ggml_blocks.split_q4_0``: codes ``[N, K]``, d float16 ``[N, K / 32]``."""
        scale = d.double()
        return cls(codes.to(torch.uint8), scale, torch.zeros_like(scale))

    @classmethod
    def from_q4_1(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Int4Affine:
        """From ``ggml_blocks.split_q4_1``: ``zero = m + 8 d`` (exact in float64: two fp16 values)."""
        scale = d.double()
        return cls(codes.to(torch.uint8), scale, m.double() + 8 * scale)

    @classmethod
    def from_q8_0(cls, q: torch.Tensor, d: torch.Tensor) -> Int4Affine:
        """From ``ggml_blocks.split_q8_0`` (int8 ``[N, K]``, d float16 ``[N, K / 32]``): the two int4 halves of the
        module docstring, concatenated along K (``input_copies = 2``)."""
        u = q.to(torch.int16) + 128  # 0..255
        high, low = (u >> 4).to(torch.uint8), (u & 0x0F).to(torch.uint8)
        scale = d.double()
        codes = torch.cat([high, low], dim=1)
        return cls(
            codes,
            torch.cat([16 * scale, scale], dim=1),
            torch.cat([torch.zeros_like(scale), 8 * scale], dim=1),
            input_copies=2,
        )

    def rows(self, index: torch.Tensor) -> Int4Affine:
        """The weight with rows ``index`` (int64 ``[N']``): ``W[index]``, exactly."""
        return Int4Affine(self.codes[index], self.scale[index], self.zero[index], self.input_copies)

    @staticmethod
    def cat(parts: Sequence[Int4Affine]) -> Int4Affine:
        """The parts stacked along N (``torch.cat(weights, 0)``), exactly. Raises ValueError when their K or input
        copies differ."""
        if len({(p.in_features, p.input_copies) for p in parts}) != 1:
            raise ValueError(f"cannot fuse weights of (K, copies) {[(p.in_features, p.input_copies) for p in parts]}")
        return Int4Affine(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            parts[0].input_copies,
        )

    def dense(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The weight ``[N, K]`` it stands for, computed in float64 (exact for every GGML type here), cast to
        ``dtype``: the reference that the packed kernel is tested against."""
        n = self.out_features
        w = (self.codes.double() - 8).view(n, -1, GROUP) * self.scale[..., None] + self.zero[..., None]
        return w.view(n, self.input_copies, self.in_features).sum(1).to(dtype)
