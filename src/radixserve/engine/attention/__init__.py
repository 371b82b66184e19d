"""Attention backends over the slot-indexed KV pool: ``torch`` (CPU, also runs on CUDA) and ``flashinfer`` (CUDA)."""

from radixserve.engine.attention.base import AttentionBackend, create_attention_backend

__all__ = ["AttentionBackend", "create_attention_backend"]
