"""The per-forward context the attention op reads: the batch, the KV pool and the attention backend.

A compiled graph can only pass tensors and scalars to an op, so the attention op (``attention_op.py``) finds the
Python-side state of the current forward here, set by the runner around each forward. vLLM does the same
(``vllm/forward_context.py``); the context is thread-local, so two engines' threads in one process never see
each other's batch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.engine.attention.base import AttentionBackend
    from radixserve.engine.memory.kv_pool import KVPool
    from radixserve.engine.model.forward_batch import ForwardBatch


@dataclass(frozen=True)
class ForwardContext:
    """What every layer's attention of one forward shares."""

    batch: ForwardBatch
    kv_pool: KVPool
    attn: AttentionBackend


_local = threading.local()


@contextlib.contextmanager
def forward_context(batch: ForwardBatch, kv_pool: KVPool, attn: AttentionBackend) -> Iterator[ForwardContext]:
    """Make ``(batch, kv_pool, attn)`` the current forward's context on this thread for the ``with`` block."""
    previous = getattr(_local, "ctx", None)
    ctx = ForwardContext(batch, kv_pool, attn)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = previous


def get_forward_context() -> ForwardContext:
    """The current forward's context. Raises RuntimeError outside ``forward_context`` (a forward run by hand)."""
    ctx: ForwardContext | None = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("attention ran outside a forward_context (run forwards through ModelRunner.forward)")
    return ctx


def forward_is_extend() -> bool:
    """Whether the current forward (if any) is a prefill (``ForwardMode.EXTEND``); False outside ``forward_context``.

    Read by the quantized linears' custom ops at run time (opaque to ``torch.compile``, like the attention op): a
    prefill takes the dequantized weight whatever its row count, so a prompt's tokens go through one kernel whether
    the radix cache held most of them or none (the int4 kernel and the dense GEMM round differently)."""
    from radixserve.engine.model.forward_batch import ForwardMode

    ctx: ForwardContext | None = getattr(_local, "ctx", None)
    return ctx is not None and ctx.batch.mode == ForwardMode.EXTEND
