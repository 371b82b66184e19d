"""Model configuration read from an HF ``config.json`` (or a GGUF file's metadata through transformers' AutoConfig).

Only the fields our Llama-family forward needs, normalised across transformers versions: RoPE parameters come from
``config.rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (older configs).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from radixserve.engine.model.locate import is_gguf_path

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder.

    ``rope_scaling`` holds the non-default RoPE parameters (``rope_type`` plus e.g. ``factor``), ``{}`` for plain RoPE.
    ``context_length`` is ``max_position_embeddings`` unless overridden.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v (and o for Llama's attention_bias) projections carry a bias
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    hidden_act: str = "silu"

    @property
    def rope_type(self) -> str:
        """``default``, ``linear``, ``dynamic``, ``llama3`` or ``yarn``."""
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")) or "default"

    @classmethod
    def from_hf_config(cls, hf: Any, context_length: int | None = None) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig``.

        Raises:
            ValueError: unsupported architecture or activation.
        """
        archs = getattr(hf, "architectures", None) or []
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(getattr(hf, "model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} (SwiGLU with silu only)")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope_theta, rope_scaling = _rope_params(hf)
        max_pos = int(hf.max_position_embeddings)
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=hf.vocab_size,
            context_length=int(context_length or max_pos),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o bias; Llama's attention_bias covers q/k/v/o
            attention_bias=is_qwen2 or bool(getattr(hf, "attention_bias", False)),
            o_proj_bias=(not is_qwen2) and bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf, "bos_token_id", None),
            hidden_act=act,
        )

    @classmethod
    def from_pretrained(cls, model_path: str, context_length: int | None = None) -> ModelConfig:
        """Read an HF directory's ``config.json`` or a ``.gguf`` file's metadata (via transformers).

        EOS ids listed in the directory's ``generation_config.json`` (e.g. Llama 3's ``<|eot_id|>``) are added.
        """
        cfg = cls.from_hf_config(load_hf_config(model_path), context_length)
        for t in generation_eos_ids(model_path):
            if t not in cfg.eos_token_ids:
                cfg.eos_token_ids.append(t)
        return cfg


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def generation_eos_ids(model_path: str) -> list[int]:
    """``eos_token_id`` of ``generation_config.json`` beside an HF checkpoint, as a list (``[]`` when absent)."""
    path = os.path.join(model_path, "generation_config.json")
    if is_gguf_path(model_path) or not os.path.exists(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def load_hf_config(model_path: str) -> Any:
    """transformers ``AutoConfig`` for an HF directory or a ``.gguf`` file path (``gguf_sidecar.load_gguf_config``:
    transformers parses a large file once, in a child process, the first time).

    Raises ValueError when transformers cannot read the GGUF's config."""
    from transformers import AutoConfig

    if is_gguf_path(model_path):
        from radixserve.engine.model.gguf_sidecar import load_gguf_config

        return load_gguf_config(model_path)
    return AutoConfig.from_pretrained(model_path)


def _rope_params(hf: Any) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, scaling dict)`` from either ``rope_parameters`` (transformers 5) or the older fields."""
    params = getattr(hf, "rope_parameters", None)
    if (
        isinstance(params, dict)
        and params
        and "full_attention" in params
        and isinstance(params["full_attention"], dict)
    ):
        params = params["full_attention"]  # per-layer-type form
    if isinstance(params, dict) and params:
        params = dict(params)
        theta = float(params.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    else:
        theta = float(getattr(hf, "rope_theta", 10000.0) or 10000.0)
        params = dict(getattr(hf, "rope_scaling", None) or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if params.get("rope_type", "default") == "default":
        params = {}
    return theta, params
