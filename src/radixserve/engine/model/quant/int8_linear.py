"""``Int8Linear``: a projection whose weight stays int8 with one scale per output row (``--torchao-config int8wo``),
run by torch's CPU int8 kernel up to ``int8_cpu.DEQUANT_ROWS`` rows and by the dequantized weight above them (the
kernel under ``--enable-deterministic-inference``, where it is batch invariant as it is). It takes the place of
``llama.Linear`` for ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj`` (``quant/on_load.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.engine.model.quant.int8_cpu import DEQUANT_ROWS, Int8Channels, int8_linear


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` ``[out_features, in_features]`` as int8 codes and per-row scales: ``x``
    ``[T, in_features]`` in the scales' dtype -> ``[T, out_features]``."""

    batch_invariant = False  # LlamaForCausalLM.set_batch_invariant: the (row-invariant) kernel for every row count

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.codes: torch.Tensor | None
        self.scale: torch.Tensor | None
        self.bias: torch.Tensor | None
        for name in ("codes", "scale", "bias"):
            self.register_buffer(name, None, persistent=False)

    def load(self, weight: Int8Channels, bias: torch.Tensor | None = None) -> None:
        """Take ``weight`` (and ``bias`` ``[out_features]``, cast to the scales' dtype).

        Raises ValueError when its shape is not ``[out_features, in_features]`` or the bias not ``[out_features]``.
        """
        if tuple(weight.codes.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"int8 weight is {list(weight.codes.shape)}, module is [{self.out_features}, {self.in_features}]"
            )
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias shape {tuple(bias.shape)} != ({self.out_features},)")
        self.codes, self.scale = weight.codes, weight.scale
        self.bias = None if bias is None else bias.to(weight.scale.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.codes is not None and self.scale is not None, "load() first"
        out: torch.Tensor = int8_linear(x, self.codes, self.scale, -1 if self.batch_invariant else DEQUANT_ROWS)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"
