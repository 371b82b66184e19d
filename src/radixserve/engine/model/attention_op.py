"""Attention as one opaque torch op, so the rest of the forward compiles into a single graph around it.

The attention backends do Python work per forward (gather indices, masks, shared-prefix groups; flashinfer plans)
that a compiler cannot trace; vLLM's answer (``unified_attention`` custom op, piecewise compilation) is ours too:
``radixserve::attention`` is registered with ``torch.library.custom_op`` and a fake (meta) implementation giving the
output shape, so ``torch.compile`` keeps it as one call and fuses everything between two layers' attentions
(o_proj + residual add + RMSNorm + MLP + the next layer's norm, QKV projection and RoPE). In eager mode it is a plain
call through the dispatcher (a few microseconds per layer).
"""

from __future__ import annotations

import torch

from radixserve.engine.model.forward_context import get_forward_context


@torch.library.custom_op("radixserve::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: torch.Tensor) -> torch.Tensor:
    """Write ``k``, ``v`` ``[T, Hkv, D]`` into the current forward's KV pool, attend ``q`` ``[T, Hq, D]``;
    returns ``[T, Hq * D]`` (see ``AttentionBackend.forward``). ``layer_index``: int64 0-d CPU-or-device tensor
    (a tensor, not an int, so one compiled layer graph serves every layer).

    The KV pool write is a side effect the compiler does not see; it is safe because nothing else in the graph
    reads the pool, and each layer's op depends on the previous layer's output.
    Raises RuntimeError outside ``forward_context``.
    """
    ctx = get_forward_context()
    out = ctx.attn.forward(q, k, v, int(layer_index.item()), ctx.kv_pool, ctx.batch)
    # a custom op's output must not alias an input (the backend returns new storage; contiguous keeps it so)
    return out.contiguous()


@attention.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: torch.Tensor) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))
