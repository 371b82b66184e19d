"""Attention backend interface over the slot-indexed KV pool, and the factory that picks one.

As in SGLang (srt/layers/attention/base_attn_backend.py) and mini-sglang (minisgl/attention/base.py): the runner calls
``init_forward_metadata`` once per forward (index/mask/plan preparation shared by all layers), then every layer calls
``forward`` which stores the new tokens' K/V at ``batch.out_cache_loc`` and attends each new token over its
sequence's context (full over the cached prefix, causal within the new tokens).
"""

from __future__ import annotations

import abc
import logging
from typing import TYPE_CHECKING

import torch

from radixserve.engine.config import ATTENTION_BACKENDS

if TYPE_CHECKING:
    from radixserve.engine.memory.kv_pool import KVPool
    from radixserve.engine.model.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

BACKEND_NAMES = ATTENTION_BACKENDS  # the --attention-backend choices


class AttentionBackend(abc.ABC):
    """One attention implementation for a model's head layout.

    Args:
        num_heads: query heads ``Hq``.
        num_kv_heads: KV heads ``Hkv`` (``Hq % Hkv == 0``; GQA when smaller).
        head_dim: ``D``.
        scale: softmax scale, usually ``D ** -0.5``.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Precompute what every layer of this forward shares (gather indices, masks, kernel plans)."""

    @abc.abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, kv_pool: KVPool, batch: ForwardBatch
    ) -> torch.Tensor:
        """Store ``k``, ``v`` ``[T, Hkv, D]`` at ``batch.out_cache_loc``; attend ``q`` ``[T, Hq, D]``; ``[T, Hq*D]``."""


def flashinfer_available() -> bool:
    """True when CUDA is available and the ``flashinfer`` package imports (never imported on CPU-only hosts)."""
    if not torch.cuda.is_available():
        return False
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA toolchain at import time
        return False
    return True


def create_attention_backend(
    name: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    scale: float | None = None,
    deterministic: bool = False,
) -> AttentionBackend:
    """Build the backend called ``name``.

    ``auto`` picks flashinfer when CUDA is available, flashinfer imports and ``dtype`` is fp16/bf16 (flashinfer has no
    fp32 kernels); otherwise the torch backend. ``deterministic`` (``--enable-deterministic-inference``) asks for
    batch-invariant attention, which only the torch backend has: ``auto`` then picks it.

    Raises:
        ValueError: unknown name, ``flashinfer`` requested where it cannot run or with ``deterministic``.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    dev = torch.device(device)
    if name == "auto":
        ok = dev.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flashinfer_available()
        name = "flashinfer" if ok and not deterministic else "torch"
    if name == "flashinfer" and deterministic:
        raise ValueError("deterministic inference needs the torch attention backend, not flashinfer")
    if name == "flashinfer":
        if dev.type != "cuda" or not flashinfer_available():
            raise ValueError("the flashinfer backend needs a CUDA device and the flashinfer package")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flashinfer backend needs float16/bfloat16, got {dtype}")
        from radixserve.engine.attention.flashinfer_gpu import FlashInferBackend

        backend: AttentionBackend = FlashInferBackend(num_heads, num_kv_heads, head_dim, dtype, dev, scale)
    else:
        from radixserve.engine.attention.torch_cpu import TorchBackend

        backend = TorchBackend(num_heads, num_kv_heads, head_dim, scale, deterministic=deterministic)
    logger.info("attention backend: %s", name)
    return backend
