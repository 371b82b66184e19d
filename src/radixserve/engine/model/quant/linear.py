"""``Int4Linear``: a projection whose weight stays 4-bit (GGUF Q4_0 / Q4_1, or Q8_0 split in two int4 halves),
run by torch's CPU int4 kernel (``int4_cpu.py``). It takes the place of ``llama.Linear`` for ``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj`` and the LM head (``load.py``); the fused projections hold their parts
concatenated along N before packing, so each is still one matmul.

Not ``prepack``-ed (the kernel has its own layout). Calls of more than ``int4_cpu.DEQUANT_ROWS`` rows (prefill) take
the weight dequantized from the packed bytes (compiled at ``load``, once per shape: ``int4_cpu.prepare_dequantize``)
and the dense GEMM, except under ``--enable-deterministic-inference`` (``batch_invariant``):
then every call runs the kernel, which computes each row on its own (``int4_cpu.py``; ``tests/test_quant_gguf.py``
checks it), so no chunking is needed, at the kernel's prefill speed.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.engine.model.quant.int4_cpu import DEQUANT_ROWS, Int4Packed, int4_linear, prepare_dequantize


class Int4Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` ``[out_features, in_features]`` packed 4-bit: ``x`` ``[T, in_features]`` in the
    dtype it was packed for -> ``[T, out_features]``.

    Built empty (on ``meta`` too: no tensors until ``load``), so a model can swap it in before it is materialised.
    """

    batch_invariant = False  # LlamaForCausalLM.set_batch_invariant: the (row-invariant) kernel for every row count

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_copies = 1
        self.qweight: torch.Tensor | None
        self.scale_zeros: torch.Tensor | None
        self.bias: torch.Tensor | None
        for name in ("qweight", "scale_zeros", "bias"):
            self.register_buffer(name, None, persistent=False)

    def load(self, packed: Int4Packed, bias: torch.Tensor | None = None) -> None:
        """Take ``packed`` (and ``bias`` ``[out_features]``, cast to the scales' dtype); compiles the prefill
        dequantization for its shape unless one is compiled already (seconds, the first time in a process).

        Raises ValueError when its shape is not ``[out_features, in_features]`` or the bias not ``[out_features]``.
        """
        if (packed.out_features, packed.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"packed weight is [{packed.out_features}, {packed.in_features}], "
                f"module is [{self.out_features}, {self.in_features}]"
            )
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias shape {tuple(bias.shape)} != ({self.out_features},)")
        self.qweight, self.scale_zeros = packed.weight, packed.scale_zeros
        self.input_copies = packed.input_copies
        self.bias = None if bias is None else bias.to(packed.scale_zeros.dtype)
        prepare_dequantize(packed.weight, packed.scale_zeros, packed.input_copies)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.qweight is not None and self.scale_zeros is not None, "load() first"
        dequant_rows = -1 if self.batch_invariant else DEQUANT_ROWS
        out: torch.Tensor = int4_linear(x, self.qweight, self.scale_zeros, self.input_copies, dequant_rows)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4, copies={self.input_copies}"
