"""Weight-only quantization of a dense checkpoint's projections at load time (``--torchao-config``, SGLang's flag
and torchao's names): ``int8wo`` (int8, one scale per output row) or ``int4wo-G`` (4-bit codes, one scale and one
zero per group of ``G`` inputs, G in 32 / 64 / 128 / 256; a K that is not a multiple of G ends in a narrower
group).

What is quantized: each decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj`` and ``down_proj``, as SGLang's
torchao path filters on ``proj``; the embedding, the LM head and the norms stay in the model dtype. A projection the
kernel cannot take (int4: N not a multiple of 16, or K not of 32) stays dense, and the log says how many did.

int4 follows torchao's ``int4_weight_only`` (tinygemm's asymmetric scheme): per group ``scale = (max - min) / 15``
and ``zero = min + 8 scale``, both rounded to the model dtype, then ``q = clamp(round((w - zero) / scale) + 8, 0,
15)``, so ``w ~ (q - 8) * scale + zero`` within ``scale / 2``. Groups wider than the kernel's 32 are stored as 32-wide
groups sharing one scale and zero (``affine.Int4Affine``): the same weights and results, 1/16 of a byte more per weight
than a G-wide layout would take. int8: ``int8_cpu.quantize_int8_channels``.

Quality, measured on the demo model (tests/test_quant_quality.py's text; bf16 perplexity 35.3): int8wo 1.00x and
int4wo-32 1.00x the perplexity, but int4wo-64 1.48x and int4wo-128 2.04x: that checkpoint's weights are already
Q4_1 (4-bit, groups of 32), and wider groups put them on a coarser grid; a clipping-range search (AWQ-style) won
only 4%. Prefer int8wo or int4wo-32 for small models.

CPU only (the kernels are torch's CPU ones); on CUDA the engine refuses the flag.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.engine.model.llama import Linear, LlamaForCausalLM
from radixserve.engine.model.quant.affine import GROUP, Int4Affine
from radixserve.engine.model.quant.int4_cpu import N_MULTIPLE, int4_supported, pack
from radixserve.engine.model.quant.int8_cpu import int8_supported, quantize_int8_channels
from radixserve.engine.model.quant.int8_linear import Int8Linear
from radixserve.engine.model.quant.linear import Int4Linear

logger = logging.getLogger(__name__)

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class WeightOnlyConfig:
    """A parsed ``--torchao-config``: ``bits`` 8 or 4, ``group_size`` (inputs per scale; int4 only)."""

    name: str
    bits: int
    group_size: int | None = None

    @classmethod
    def parse(cls, name: str) -> WeightOnlyConfig:
        """``int8wo`` or ``int4wo-G``. Raises ValueError naming the accepted values otherwise."""
        if name == "int8wo":
            return cls(name, 8)
        head, _, group = name.partition("-")
        if head == "int4wo" and group.isdigit() and int(group) in INT4_GROUP_SIZES:
            return cls(name, 4, int(group))
        accepted = ", ".join(["int8wo"] + [f"int4wo-{g}" for g in INT4_GROUP_SIZES])
        raise ValueError(f"unknown --torchao-config {name!r}; choose one of {accepted}")


@dataclass(frozen=True)
class QuantizedSummary:
    """What ``quantize_projections`` did: modules quantized / kept dense, weight bytes before and after (bytes)."""

    quantized: int
    kept_dense: int
    bytes_before: int
    bytes_after: int


def _affine_params(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero (rounded to ``dtype``, held in float32) mapping codes 0..15 onto ``[lo, hi]``."""
    scale = ((hi - lo).clamp(min=1e-6) / 15).to(dtype).float()
    return scale, (lo + 8 * scale).to(dtype).float()


def quantize_int4_groups(weight: torch.Tensor, group_size: int, dtype: torch.dtype) -> Int4Affine:
    """``weight`` ``[N, K]`` as an ``Int4Affine`` with one scale and zero per ``group_size`` inputs (module
    docstring; when K is not a multiple of ``group_size`` the last group is narrower); scale and zero are rounded to
    ``dtype`` before the codes are chosen, so the packed kernel (which rounds them to ``dtype`` too) computes with
    exactly the values the codes were chosen for.

    Raises ValueError when K or ``group_size`` is not a multiple of 32 (the kernel's group).
    """
    n, k = weight.shape
    if k % GROUP or group_size % GROUP:
        raise ValueError(f"K = {k} and the group size {group_size} must be multiples of {GROUP}")
    groups = -(-k // group_size)
    # the last group padded with its own last column: its min and max stay its own
    padded = F.pad(weight.float()[None], (0, groups * group_size - k), mode="replicate")[0]
    w = padded.view(n, groups, group_size)
    scale, zero = _affine_params(w.amin(-1), w.amax(-1), dtype)
    codes = (torch.round((w - zero[..., None]) / scale[..., None]) + 8).clamp(0, 15).to(torch.uint8)
    repeat = group_size // GROUP
    scale_32, zero_32 = (t.repeat_interleave(repeat, dim=1)[:, : k // GROUP].double() for t in (scale, zero))
    return Int4Affine(codes.view(n, -1)[:, :k].contiguous(), scale_32, zero_32)


def _quantized(module: Linear, config: WeightOnlyConfig, dtype: torch.dtype) -> nn.Module | None:
    """The quantized replacement of ``module`` (dense, loaded), or None where the kernel cannot take its shape."""
    weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    n, k = weight.shape
    if config.bits == 8:
        int8 = Int8Linear(k, n)
        int8.load(quantize_int8_channels(weight, dtype), bias)
        return int8
    assert config.group_size is not None
    if n % N_MULTIPLE or k % GROUP:
        return None
    int4 = Int4Linear(k, n)
    int4.load(pack(quantize_int4_groups(weight, config.group_size, dtype), dtype), bias)
    return int4


def _module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def check_weight_only_supported(config: WeightOnlyConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError unless ``config``'s kernels run on ``device`` in ``dtype`` (CPU, float32 / bfloat16 /
    float16): checked before the weights load, so a CUDA run is refused at once, not after minutes of loading."""
    supported = int8_supported if config.bits == 8 else int4_supported
    if not supported(device, dtype):
        raise ValueError(
            f"--torchao-config {config.name} runs torch's CPU kernels: CPU with float32 / bfloat16 / float16 only, "
            f"not {device.type} {dtype}"
        )


def quantize_projections(model: LlamaForCausalLM, config: WeightOnlyConfig) -> QuantizedSummary:
    """Replace each decoder layer's dense projections (loaded, not yet prepacked) by ``Int8Linear`` / ``Int4Linear``
    modules (module docstring); one projection at a time, so at most one dense and one quantized copy of a matrix
    exist together.

    Raises ValueError off CPU or for a dtype the kernels do not take (float32 / bfloat16 / float16 on CPU).
    """
    probe = model.model.norm.weight
    check_weight_only_supported(config, probe.device, probe.dtype)
    quantized = kept = before = after = 0
    for layer in model.model.layers:
        for path in PROJECTIONS:
            parent_path, _, attr = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            module = cast(Linear, getattr(parent, attr))
            new = _quantized(module, config, probe.dtype)
            if new is None:
                kept += 1
                continue
            before, after = before + _module_bytes(module), after + _module_bytes(new)
            setattr(parent, attr, new)
            quantized += 1
    summary = QuantizedSummary(quantized, kept, before, after)
    logger.info(
        "--torchao-config %s: %d projections quantized (%.1f MB -> %.1f MB), %d kept dense",
        config.name,
        quantized,
        before / 1e6,
        after / 1e6,
        kept,
    )
    return summary
