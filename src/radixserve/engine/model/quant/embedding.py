"""``GroupedEmbedding``: a token embedding kept as GGML codes; only the looked-up rows are dequantized.

Per group of 32 along the hidden dim, ``row = codes * scale + zero`` in float32, then cast to the model dtype: for Q8_0
(``zero = 0``), Q4_1 (``zero = m``) and Q4_0 (``codes - 8`` folded into ``zero = -8 d``) every product and sum is
exact in float32 (an 8-bit code times an fp16 scale needs 19 bits), as gguf-py's ``dequantize`` computes it, so a row
equals ``gguf.quants.dequantize`` cast to the model dtype, bit for bit. Memory: one byte per code (Q4 codes are not
nibble-packed here) plus float32 scales and zeros, 1.2-1.3 bytes a weight instead of bfloat16's 2.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.engine.model.quant.affine import GROUP


class GroupedEmbedding(nn.Module):
    """``ids`` int64 ``[T]`` -> ``[T, hidden]`` in ``dtype``, from ``codes`` ``[vocab, hidden]`` (int8 or uint8),
    ``scale`` and ``zero`` float32 ``[vocab, hidden / 32]`` (``zero`` None for none), given to ``load``.

    Built empty (on ``meta`` too), so a model can swap it in before it is materialised.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.codes: torch.Tensor | None
        self.scale: torch.Tensor | None
        self.zero: torch.Tensor | None
        for name in ("codes", "scale", "zero"):
            self.register_buffer(name, None, persistent=False)

    def load(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
        """Take the codes and the group scales (and zeros). Raises ValueError when the shapes are not ``[vocab,
        hidden]`` and ``[vocab, hidden / 32]``."""
        shape = (self.num_embeddings, self.embedding_dim)
        groups = (self.num_embeddings, self.embedding_dim // GROUP)
        if tuple(codes.shape) != shape or self.embedding_dim % GROUP or tuple(scale.shape) != groups:
            raise ValueError(f"codes {tuple(codes.shape)} / scale {tuple(scale.shape)} are not {shape} / {groups}")
        if zero is not None and tuple(zero.shape) != groups:
            raise ValueError(f"zero {tuple(zero.shape)} != {groups}")
        self.codes, self.scale = codes, scale.float()
        self.zero = None if zero is None else zero.float()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.codes is not None and self.scale is not None, "GroupedEmbedding.load() first"
        t = ids.shape[0]
        rows = self.codes[ids].view(t, -1, GROUP).float() * self.scale[ids][..., None]
        if self.zero is not None:
            rows = rows + self.zero[ids][..., None]
        return rows.view(t, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, grouped codes"
