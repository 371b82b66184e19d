"""Llama-family decoder (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k RMSNorm) over a slot-indexed KV pool.

Structure after nano-vllm (nanovllm/models/qwen3.py) and SGLang (srt/models/llama.py): q/k/v and gate/up projections
are fused into one matmul each (the loader writes HF's separate tensors into their shards), the residual add is fused
into the following RMSNorm (``norm(x, residual)``, SGLang's ``fused_add_rmsnorm`` form), attention is one opaque op
(``attention_op.py``) that calls the current forward's ``AttentionBackend``, and only the rows that need logits go
through the final norm and the LM head. The forward takes tensors only, so ``torch.compile`` can turn all of it but
attention into one graph (``compile.py``). Module names mirror HF's (``model.layers.N.self_attn...``) so checkpoints
map 1:1 apart from the fused shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.engine.model import attention_op, prepack
from radixserve.engine.model.batch_invariant import batch_invariant_linear
from radixserve.engine.model.config import ModelConfig
from radixserve.engine.model.quant.int8_linear import Int8Linear
from radixserve.engine.model.quant.linear import Int4Linear
from radixserve.engine.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 and cast back as HF's LlamaRMSNorm does. ``[..., dim]``.

    ``norm(x)`` returns the normalised ``x``; ``norm(x, residual)`` first adds ``residual`` (in the model dtype, as
    HF's ``residual + hidden``) and returns ``(normalised sum, sum)``: the sum is the next residual.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dt)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: the residual add fused with the norm that follows it."""
        summed = residual + x
        return self(summed), summed


class Linear(nn.Linear):
    """``nn.Linear`` without gradients, its GEMM dense (``F.linear``) or prepacked for oneDNN (``prepack.py``; after
    ``prepack()`` the dense weight is gone), either of them batch-invariant (``batch_invariant.py``, for
    ``--enable-deterministic-inference``: row ``i`` of the output depends only on row ``i`` of the input)."""

    batch_invariant = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pack_handle: torch.Tensor | None
        self.register_buffer("pack_handle", None, persistent=False)

    def prepack(self) -> None:
        """Pack the weight for ``prepack.packed_linear`` and release the dense copy (call after loading)."""
        self.pack_handle = prepack.pack_linear(self, self.weight, self.bias)
        self.weight = nn.Parameter(self.weight.new_empty((0,)), requires_grad=False)
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pack_handle is not None:
            out: torch.Tensor = prepack.packed_linear(x, self.pack_handle, self.out_features, self.batch_invariant)
            return out
        if self.batch_invariant:
            return batch_invariant_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def _linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype, device: torch.device | str) -> Linear:
    lin = Linear(n_in, n_out, bias=bias, dtype=dtype, device=device)
    lin.weight.requires_grad_(False)
    if bias:
        lin.bias.requires_grad_(False)
    return lin


class LlamaAttention(nn.Module):
    """Self-attention with fused ``qkv_proj`` ``[hidden -> (Hq + 2 Hkv) * D]``, RoPE, GQA via the backend."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_id: int,
        rope: RotaryEmbedding | None,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.layer_index: torch.Tensor  # registered by LlamaForCausalLM.materialize
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = _linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, dtype, device)
        self.o_proj = _linear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, device)
        self.rope = rope  # shared by all layers; set after weights are materialised

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> ``[T, hidden_size]``; writes this layer's K/V for the new tokens."""
        T = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        assert self.rope is not None, "LlamaForCausalLM.materialize() sets the shared RoPE cache"
        q, k = self.rope(positions, q, k)
        o = attention_op.attention(q, k, v, self.layer_index)
        out: torch.Tensor = self.o_proj(o)
        return out


class LlamaMLP(nn.Module):
    """SwiGLU MLP (Shazeer 2020) with fused ``gate_up_proj`` ``[hidden -> 2 * intermediate]``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * self.inter, cfg.mlp_bias, dtype, device)
        self.down_proj = _linear(self.inter, cfg.hidden_size, cfg.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        out: torch.Tensor = self.down_proj(F.silu(gate) * up)
        return out


class LlamaDecoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, with the residual carried apart.

    ``forward(hidden, residual)`` takes the previous block's MLP output and the residual stream before it (``None``
    for the first block: ``hidden`` is then the embedding) and returns this block's ``(mlp output, residual)``; the
    add of the two happens inside the next norm.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, None, dtype, device)
        self.mlp = LlamaMLP(cfg, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_norm(hidden, residual)
        attn_out = self.self_attn(normed, positions)
        normed, residual = self.post_attention_layernorm.add_norm(attn_out, residual)
        return self.mlp(normed), residual


# (layer, hidden, residual, positions) -> (hidden, residual): how the model calls each decoder layer
LayerRunner = Callable[
    [LlamaDecoderLayer, torch.Tensor, torch.Tensor | None, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        embed.weight.requires_grad_(False)
        # nn.Module: GGUF weights kept quantized swap in quant.embedding.GroupedEmbedding (quant/load.py)
        self.embed_tokens: nn.Module = embed
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    """The whole causal LM. Build on ``device="meta"``, then ``materialize`` and load weights.

    ``forward`` returns float32 logits of the rows it is asked for (each sequence's last new token); run it inside
    ``forward_context`` (``ModelRunner.forward`` does).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "meta") -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, dtype, device)
        # nn.Module: GGUF weights kept quantized swap in quant.linear.Int4Linear (quant/load.py), also when tied
        self.lm_head: nn.Module | None = (
            None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        )
        self.rope: RotaryEmbedding | None = None
        self.batch_invariant = False
        self.lm_head_pack: torch.Tensor | None  # the tied LM head's packed copy (``prepack``)
        self.register_buffer("lm_head_pack", None, persistent=False)

    def set_batch_invariant(self, on: bool) -> None:
        """Every projection and the LM head batch-invariant (``--enable-deterministic-inference``) or not."""
        self.batch_invariant = on
        for m in self.modules():
            if isinstance(m, (Linear, Int4Linear, Int8Linear)):
                m.batch_invariant = on

    def prepack(self, force: bool = False) -> bool:
        """Prepack every projection and the LM head for oneDNN (``prepack.py``) where it pays (``prepack_pays``), or
        with ``force`` wherever the device and dtype allow it; True when it packed anything. A tied LM head is packed
        as a copy (the embedding lookup keeps the dense matrix). Modules that are not ``Linear``
        (``quant.linear.Int4Linear``, ``quant.int8_linear.Int8Linear``: quantized weights) keep their own layout."""
        probe = self.model.norm.weight  # the model's dtype and device (a quantized LM head has no dense weight)
        wanted = prepack.prepack_supported if force else prepack.prepack_pays
        if not wanted(probe.dtype, probe.device):
            return False
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.prepack()
        if self.lm_head is None:
            self.lm_head_pack = prepack.pack_linear(self, self.lm_head_weight(), None)
        return bool(linears) or self.lm_head is None

    def packed_bytes(self) -> int:
        """Bytes held by prepacked weights (not counted by ``parameters()``)."""
        handles = [m.pack_handle for m in self.modules() if isinstance(m, Linear) and m.pack_handle is not None]
        if self.lm_head_pack is not None:
            handles.append(self.lm_head_pack)
        return sum(prepack.packed_bytes(h) for h in handles)

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocate (uninitialised) storage on ``device`` and build the RoPE cos/sin cache there."""
        self.to_empty(device=device)
        cfg = self.config
        self.rope = RotaryEmbedding(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.context_length,
            cfg.max_position_embeddings,
            dtype,
            device,
        )
        for layer in self.model.layers:
            attn = cast(LlamaDecoderLayer, layer).self_attn  # nn.ModuleList iterates as plain Module
            attn.rope = self.rope
            # The layer index as a tensor: a compiled layer reads it as an input, so all layers share one graph.
            # On the CPU even with the weights on CUDA: the attention op reads it with .item(), which must not sync.
            attn.register_buffer("layer_index", torch.tensor(attn.layer_id), persistent=False)

    def lm_head_weight(self) -> torch.Tensor:
        """``[vocab, hidden]``: the embedding matrix when tied, else ``lm_head.weight`` (dense modules only)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        assert isinstance(weight, torch.Tensor), "a quantized embedding or LM head has no dense weight"
        return weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        run_layer: LayerRunner | None = None,
    ) -> torch.Tensor:
        """All layers over the new tokens, then the final norm and LM head over the rows that need logits.

        Args:
            input_ids: int64 ``[num_tokens]``; positions: int64 ``[num_tokens]``.
            logits_indices: int64 ``[batch]``, the rows of ``input_ids`` whose next-token logits are wanted.
            run_layer: calls each decoder layer (``compile.CompiledLayers``); None calls it eagerly.
        Returns:
            float32 logits ``[batch, vocab]``.
        """
        return self.compute_logits(self.hidden_states(input_ids, positions, logits_indices, run_layer))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        run_layer: LayerRunner | None = None,
    ) -> torch.Tensor:
        """All layers over the new tokens, then the final norm over ``rows`` only (the LM head's input).

        Args:
            input_ids: int64 ``[num_tokens]``; positions: int64 ``[num_tokens]``.
            rows: int64 ``[R]``, the rows of ``input_ids`` whose final hidden states are wanted (any order).
            run_layer: calls each decoder layer (``compile.CompiledLayers``); None calls it eagerly.
        Returns:
            ``[R, hidden_size]`` in the model dtype, normalised by the final RMSNorm.
        """
        hidden = self.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            block = cast(LlamaDecoderLayer, layer)
            if run_layer is None:
                hidden, residual = block(hidden, residual, positions)
            else:
                hidden, residual = run_layer(block, hidden, residual, positions)
        assert residual is not None, "a model has at least one layer"
        # row-wise from here on: pick the rows first, so the norm and the LM head run on the wanted rows only
        normed, _ = self.model.norm.add_norm(hidden[rows], residual[rows])
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: float32 logits ``[R, vocab]`` of final hidden states ``[R, hidden_size]`` (``hidden_states``).

        A row's logits are a function of that row alone, so the rows may be given in chunks (bit-identical across
        chunkings only under ``set_batch_invariant``; otherwise the GEMM's summation order may follow the row count)."""
        if self.lm_head is not None:
            return cast(torch.Tensor, self.lm_head(hidden)).float()
        if self.lm_head_pack is not None:
            packed: torch.Tensor = prepack.packed_linear(
                hidden, self.lm_head_pack, self.config.vocab_size, self.batch_invariant
            )
            return packed.float()
        if self.batch_invariant:
            return batch_invariant_linear(hidden, self.lm_head_weight()).float()
        return F.linear(hidden, self.lm_head_weight()).float()
