"""GGML's 32-element quantization blocks (Q4_0, Q4_1, Q8_0) split into integer codes and fp16 scales, exactly.

Block layouts from ggml (``ggml/src/ggml-common.h``: ``block_q4_0``, ``block_q4_1``, ``block_q8_0``) and gguf-py's
``gguf/quants.py`` (``Q4_0.dequantize_blocks`` etc.), which define the values:

- Q4_0, 18 bytes: ``d`` fp16, then 16 bytes of nibbles. Element ``j < 16`` is the low nibble of byte ``j``, element
  ``j + 16`` its high nibble. ``w = (q - 8) * d``.
- Q4_1, 20 bytes: ``d`` fp16, ``m`` fp16, then the same 16 bytes of nibbles. ``w = q * d + m``.
- Q8_0, 34 bytes: ``d`` fp16, then 32 int8 ``q``. ``w = q * d``.

Every function takes a tensor's raw rows as GGUF stores them, uint8 ``[N, K / 32 * block_bytes]`` (GGUF lists the
shape ``[K, N]``, ne0 first; a row is one output feature, its blocks run along the input dim ``K``), and returns
torch tensors with ``N`` rows. Nothing is rounded: codes are integers and the scales stay fp16.
"""

from __future__ import annotations

import torch

BLOCK = 32  # elements per block, along K, for every type here
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _blocks(raw: torch.Tensor, type_name: str) -> torch.Tensor:
    """``raw`` uint8 ``[N, G * block_bytes]`` viewed as ``[N, G, block_bytes]``. Raises ValueError on a bad shape."""
    size = BLOCK_BYTES[type_name]
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % size:
        raise ValueError(f"{type_name} rows must be uint8 [N, G * {size}], got {raw.dtype} {tuple(raw.shape)}")
    return raw.reshape(raw.shape[0], raw.shape[1] // size, size)


def _fp16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian fp16 at byte ``offset`` of every block: ``[N, G]`` float16."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[N, G, 16]`` bytes -> ``[N, G * 32]`` uint8 codes 0..15 (low nibbles are elements 0-15, high 16-31)."""
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    return codes.reshape(qs.shape[0], -1)


def split_q4_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 rows -> ``(codes, d)``: uint8 codes 0..15 ``[N, K]`` and float16 scales ``[N, K / 32]``;
    ``w[n, k] = (codes[n, k] - 8) * d[n, k // 32]``. Raises ValueError when ``raw`` is not ``[N, G * 18]`` uint8."""
    b = _blocks(raw, "Q4_0")
    return _nibbles(b[..., 2:18]), _fp16(b, 0)


def split_q4_1(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows -> ``(codes, d, m)``: uint8 codes 0..15 ``[N, K]``, float16 scales and minimums ``[N, K / 32]``;
    ``w[n, k] = codes[n, k] * d[n, k // 32] + m[n, k // 32]``. Raises ValueError when ``raw`` is not
    ``[N, G * 20]`` uint8."""
    b = _blocks(raw, "Q4_1")
    return _nibbles(b[..., 4:20]), _fp16(b, 0), _fp16(b, 2)


def split_q8_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> ``(q, d)``: int8 ``[N, K]`` and float16 scales ``[N, K / 32]``; ``w[n, k] = q[n, k] *
    d[n, k // 32]``. Raises ValueError when ``raw`` is not ``[N, G * 34]`` uint8."""
    b = _blocks(raw, "Q8_0")
    q = b[..., 2:34].contiguous().view(torch.int8).reshape(raw.shape[0], -1)
    return q, _fp16(b, 0)
