"""Rotary position embedding (RoPE, Su et al. 2021) with the scaling variants Llama-family checkpoints use.

The cos/sin table is precomputed once for ``context_length`` positions (nano-vllm / SGLang ``get_rope`` style) and
indexed by absolute position, so a token's rotation does not depend on the batch it runs in. Rotation is the
"rotate_half" (GPT-NeoX) layout HF Llama checkpoints use. Frequencies follow transformers' ``modeling_rope_utils``:
linear (position interpolation, Chen et al. 2023), llama3 (Meta's Llama 3.1 band-wise scaling), yarn (Peng et al.
2023) and dynamic NTK — the latter precomputed statically for ``context_length`` as SGLang does (HF recomputes it per
sequence length, so the two differ only past ``max_position_embeddings``).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], context_length: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (float32) and the cos/sin multiplier (YaRN's attention factor).

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    dim = head_dim
    rope_type = scaling.get("rope_type", "default")
    base_inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return base_inv, 1.0
    if rope_type == "linear":
        return base_inv / float(scaling["factor"]), 1.0
    if rope_type == "dynamic":
        factor = float(scaling["factor"])
        orig = int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
        if context_length <= orig:
            return base_inv, 1.0
        new_theta = theta * ((factor * context_length / orig) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (new_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / base_inv
        inv = torch.where(wavelen > low_wavelen, base_inv / factor, base_inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, inv), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear, dynamic, llama3, yarn)")


def _yarn_inv_freq(dim: int, theta: float, s: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: blend interpolated and extrapolated frequencies with a linear ramp over the correction range."""
    orig = int(s["original_max_position_embeddings"])
    factor = s.get("factor") or max_pos / orig
    factor = float(factor)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = get_mscale(factor, m) / get_mscale(factor, m_all) if (m and m_all) else get_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extra, inter = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    return inter * (1 - extra_factor) + extra * extra_factor, float(attn)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin cache ``[context_length, head_dim]`` applied to q/k by absolute position."""

    cos: torch.Tensor  # buffers registered in __init__
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any],
        context_length: int,
        max_position_embeddings: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        inv_freq, mscale = rope_inv_freq(head_dim, theta, scaling, context_length, max_position_embeddings)
        t = torch.arange(context_length, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [context, head_dim/2], fp32 as HF computes it
        emb = torch.cat((freqs, freqs), dim=-1)
        # cast to the model dtype once, as HF casts cos/sin to the activations' dtype
        self.register_buffer("cos", (emb.cos() * mscale).to(dtype).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * mscale).to(dtype).to(device), persistent=False)
        self.context_length = context_length

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` by int64 ``positions`` ``[T]``.

        Raises IndexError (from indexing) for a position >= context_length.
        """
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
