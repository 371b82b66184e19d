"""Fill a ``LlamaForCausalLM`` from a GGUF file with its projections kept quantized (``ModelRunner(quantization=
"gguf")``, ``--quantization gguf``).

What each tensor becomes:

- ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``: when every part is Q4_0 or Q4_1, an ``Int4Linear`` (the
  parts' ``Int4Affine`` concatenated along N, q/k rows un-permuted first for GGUF architecture ``llama``); else (F32,
  F16, BF16, Q8_0: see ``Q8_0_AS_INT4``, or mixed parts) the dense ``Linear`` as before, dequantized by gguf-py.
  Any other type (K-quants, ...) raises UnsupportedGGUFType.
- The token embedding: Q4_0 / Q4_1 / Q8_0 a ``GroupedEmbedding`` (rows dequantized on lookup), float types dense.
- The LM head (``output.weight``, or the embedding when tied): Q4_0 / Q4_1 an ``Int4Linear``; Q8_0 and float types a
  dense ``Linear`` (its own copy when the embedding is grouped codes; prepacked for oneDNN like every ``Linear``).
- Norms (F32) and biases: dense, in the model dtype.

The modules are swapped while the model is still on ``meta``, so no dense copy of a quantized weight is ever
allocated; every parameter must be written once, else loading fails, as ``loader.load_weights``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from radixserve.engine.model.llama import Linear, LlamaAttention, LlamaForCausalLM, LlamaMLP
from radixserve.engine.model.quant.affine import Int4Affine
from radixserve.engine.model.quant.embedding import GroupedEmbedding
from radixserve.engine.model.quant.ggml_blocks import split_q4_0, split_q4_1, split_q8_0
from radixserve.engine.model.quant.gguf_file import GGUFFile, GGUFTensor, UnsupportedGGUFType, hf_name
from radixserve.engine.model.quant.int4_cpu import N_MULTIPLE, int4_supported, pack
from radixserve.engine.model.quant.linear import Int4Linear
from radixserve.engine.model.quant.rope_permute import PERMUTED_ARCHITECTURES, reverse_rope_permutation

logger = logging.getLogger(__name__)

# Q8_0 matmuls as two int4 halves (``affine.py``): exact, but measured slower than the prepacked bfloat16 GEMM but at
# one row (bench/quant_kernels.py, Xeon with AMX, 1 thread: the 576 -> 49152 LM head 0.52x at 1 row, 2.4x at 8;
# 576 -> 1536 1.4x at 1 row), so Q8_0 projections and LM heads are dequantized to the model dtype instead.
Q8_0_AS_INT4 = False
INT4_TYPES = ("Q4_0", "Q4_1") + (("Q8_0",) if Q8_0_AS_INT4 else ())
EMBEDDING_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # kept as grouped codes, rows dequantized on lookup
DENSE_TYPES = ("F32", "F16", "BF16")
# matrices dequantized to the model dtype when not all parts of a module stay int4 (mixed parts, Q8_0)
DEQUANTIZED_TYPES = DENSE_TYPES + ("Q4_0", "Q4_1", "Q8_0")

# fused module -> its HF parts, in the order they are stacked along N
_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def affine_from_gguf(t: GGUFTensor) -> Int4Affine:
    """The exact ``Int4Affine`` of a Q4_0 / Q4_1 / Q8_0 matrix ``[N, K]``.

    Raises UnsupportedGGUFType, naming the tensor and its type, for any other type.
    """
    if t.type_name == "Q4_0":
        return Int4Affine.from_q4_0(*split_q4_0(t.raw_rows()))
    if t.type_name == "Q4_1":
        return Int4Affine.from_q4_1(*split_q4_1(t.raw_rows()))
    if t.type_name == "Q8_0":
        return Int4Affine.from_q8_0(*split_q8_0(t.raw_rows()))
    raise UnsupportedGGUFType(
        f"{t.name}: GGML type {t.type_name} cannot be kept quantized (supported: Q4_0, Q4_1, Q8_0; "
        f"{', '.join(DENSE_TYPES)} load dense); --quantization none dequantizes it"
    )


def _with_copies(w: Int4Affine, copies: int) -> Int4Affine:
    """``w`` over ``copies`` input copies, the extra ones all zero (code 8, scale 0, zero 0): exact, so parts of
    Q4 and Q8_0 can share one fused matmul."""
    if w.input_copies == copies:
        return w
    pad = copies // w.input_copies - 1
    codes = torch.cat([w.codes] + [torch.full_like(w.codes, 8)] * pad, dim=1)
    zeros = [torch.zeros_like(w.scale)] * pad
    return Int4Affine(codes, torch.cat([w.scale, *zeros], 1), torch.cat([w.zero, *zeros], 1), copies)


@dataclass
class _Plan:
    """Which modules are quantized; filled while the model is on ``meta``."""

    quantized: dict[str, list[str]] = field(default_factory=dict)  # module path -> GGUF tensor names of its parts
    embedding_quantized: bool = False
    head_source: str | None = None  # the GGUF tensor of an Int4Linear LM head, else None


class _Loader:
    def __init__(self, model: LlamaForCausalLM, f: GGUFFile, dtype: torch.dtype) -> None:
        self.model, self.f, self.dtype, self.cfg = model, f, dtype, model.config
        self.by_hf: dict[str, str] = {}  # HF name -> GGUF name
        for name in f.names():
            target = hf_name(name)
            if target is not None:
                self.by_hf[target] = name
        self.permute = f.architecture in PERMUTED_ARCHITECTURES
        self.loaded: set[str] = set()

    def gguf(self, hf: str) -> GGUFTensor:
        if hf not in self.by_hf:
            raise ValueError(f"{self.f.path} has no tensor for {hf}")
        return self.f.tensor(self.by_hf[hf])

    def rope_rows(self, hf: str, rows: int) -> torch.Tensor | None:
        """The un-permuting row order of a q/k tensor (or its bias), None for every other tensor."""
        if not self.permute:
            return None
        if ".q_proj." in hf:
            return reverse_rope_permutation(rows, self.cfg.num_heads)
        if ".k_proj." in hf:
            return reverse_rope_permutation(rows, self.cfg.num_kv_heads)
        return None

    # ---- phase 1, on meta: swap the modules that stay quantized
    def plan(self) -> _Plan:
        plan = _Plan()
        for i, layer in enumerate(self.model.model.layers):
            for fused, parts in _PARTS.items():
                names = [f"model.layers.{i}.{p}.weight" for p in parts]
                types = {self.gguf(n).type_name for n in names}
                module = cast(Linear, layer.get_submodule(fused))  # still the dense module on meta
                if types <= set(INT4_TYPES) and module.out_features % N_MULTIPLE == 0:
                    self._swap(layer, fused, Int4Linear(module.in_features, module.out_features))
                    plan.quantized[f"model.layers.{i}.{fused}"] = names
                else:
                    self._check_dequantizable(names)
        embd = self.gguf("model.embed_tokens.weight")
        cfg = self.cfg
        if embd.type_name in EMBEDDING_TYPES:
            self.model.model.embed_tokens = GroupedEmbedding(cfg.vocab_size, cfg.hidden_size, self.dtype)
            plan.embedding_quantized = True
        else:
            self._check_dequantizable(["model.embed_tokens.weight"])
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        head = self.gguf(head_name)
        if head.type_name in INT4_TYPES and cfg.vocab_size % N_MULTIPLE == 0:
            self.model.lm_head = Int4Linear(cfg.hidden_size, cfg.vocab_size)
            plan.head_source = head.name
        elif cfg.tie_word_embeddings and plan.embedding_quantized:
            # a quantized embedding holds no dense matrix to tie to: the head gets its own (prepacked later)
            self.model.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=self.dtype, device="meta")
            self.model.lm_head.weight.requires_grad_(False)
        else:
            self._check_dequantizable([head_name])
        return plan

    def _check_dequantizable(self, names: list[str]) -> None:
        """Raise UnsupportedGGUFType, naming the tensor and its type, when one of ``names`` cannot be loaded dense."""
        for n in names:
            t = self.gguf(n)
            if t.type_name not in DEQUANTIZED_TYPES:
                affine_from_gguf(t)  # raises, naming it

    @staticmethod
    def _swap(layer: nn.Module, path: str, new: nn.Module) -> None:
        parent, _, attr = path.rpartition(".")
        owner = layer.get_submodule(parent)
        assert isinstance(owner, (LlamaAttention, LlamaMLP))
        setattr(owner, attr, new)

    # ---- phase 3, after materialize: write every tensor
    def fill(self, plan: _Plan) -> None:
        params = dict(self.model.named_parameters())
        for module_path, names in plan.quantized.items():
            self._fill_int4(module_path, names)
        for target, dst in params.items():
            if target in self.loaded:
                continue
            self._fill_dense(target, dst)
        if plan.embedding_quantized:
            self._fill_embedding()
        if plan.head_source is not None:
            head = self.model.lm_head
            assert isinstance(head, Int4Linear)
            head.load(pack(affine_from_gguf(self.f.tensor(plan.head_source)), self.dtype))
        missing = set(params) - self.loaded
        if missing:
            raise ValueError(f"weights missing from {self.f.path}: {sorted(missing)[:8]} ({len(missing)} in all)")

    def _fill_int4(self, module_path: str, names: list[str]) -> None:
        parts = []
        for n in names:
            w = affine_from_gguf(self.gguf(n))
            rows = self.rope_rows(n, w.out_features)
            parts.append(w if rows is None else w.rows(rows))
        copies = max(p.input_copies for p in parts)
        fused = Int4Affine.cat([_with_copies(p, copies) for p in parts])
        bias = None
        bias_names = [n[: -len("weight")] + "bias" for n in names]
        if all(b in self.by_hf for b in bias_names):
            bias = torch.cat([self._dense_values(b) for b in bias_names])
        module = self.model.get_submodule(module_path)
        assert isinstance(module, Int4Linear)
        module.load(pack(fused, self.dtype), bias)

    def _dense_values(self, hf: str) -> torch.Tensor:
        """The dequantized (float32) values of ``hf``'s GGUF tensor, q/k rows un-permuted."""
        values = self.gguf(hf).dequantize()
        rows = self.rope_rows(hf, values.shape[0])
        return values if rows is None else values[rows]

    def _fill_dense(self, target: str, dst: torch.Tensor) -> None:
        parts = target.split(".")
        fused = ".".join(parts[-3:-1])
        if fused in _PARTS:  # a dense fused projection: its parts stacked along N
            prefix = ".".join(parts[:-3])
            values = torch.cat([self._dense_values(f"{prefix}.{p}.{parts[-1]}") for p in _PARTS[fused]])
        elif target == "lm_head.weight" and self.cfg.tie_word_embeddings:
            values = self._dense_values("model.embed_tokens.weight")
        else:
            values = self._dense_values(target)
        if tuple(values.shape) != tuple(dst.shape):
            raise ValueError(f"{target}: GGUF shape {tuple(values.shape)} != parameter {tuple(dst.shape)}")
        dst.data.copy_(values)
        self.loaded.add(target)

    def _fill_embedding(self) -> None:
        t = self.gguf("model.embed_tokens.weight")
        raw = t.raw_rows()
        emb = self.model.model.embed_tokens
        assert isinstance(emb, GroupedEmbedding)
        if t.type_name == "Q8_0":
            q, d = split_q8_0(raw)
            emb.load(q, d.float(), None)
        elif t.type_name == "Q4_1":
            codes, d, m = split_q4_1(raw)
            emb.load(codes, d.float(), m.float())
        else:
            codes, d = split_q4_0(raw)
            emb.load(codes, d.float(), -8 * d.float())


def load_gguf_quantized(model: LlamaForCausalLM, gguf_path: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Materialise ``model`` (built on ``meta``) on ``device`` and fill it from ``gguf_path``, keeping Q4_0 / Q4_1 /
    Q8_0 projections, embedding and LM head quantized (module docstring). Replaces ``materialize`` + ``load_weights``.
    Returns whether any tensor was kept quantized (False for a file of F32 / F16 / BF16 tensors only, served dense).

    Raises:
        ValueError: not CPU or not float32 / bfloat16 / float16; a tensor missing or of the wrong shape; parameters
            left unloaded.
        UnsupportedGGUFType: a tensor of a GGML type that is neither kept quantized nor dense (its name and type in
            the message).
        KeyError: a GGUF tensor the model has no place for.
    """
    if not int4_supported(device, dtype):
        raise ValueError(
            f"GGUF weights stay quantized on CPU with float32 / bfloat16 / float16 only, not {device} {dtype}"
        )
    if dtype != torch.bfloat16:
        logger.warning("int4 GEMMs in %s run torch's scalar kernel (only bfloat16 is vectorized): slow", dtype)
    loader = _Loader(model, GGUFFile(gguf_path), dtype)
    plan = loader.plan()
    model.materialize(device, dtype)
    loader.fill(plan)
    logger.info(
        "GGUF weights kept quantized: %d of %d projections int4, embedding %s, LM head %s",
        len(plan.quantized),
        len(_PARTS) * len(model.model.layers),
        "grouped codes" if plan.embedding_quantized else "dense",
        "int4" if plan.head_source else "dense",
    )
    return bool(plan.quantized or plan.embedding_quantized or plan.head_source)
