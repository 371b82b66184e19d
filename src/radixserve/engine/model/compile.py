"""The compiled forward: ``torch.compile`` (inductor; C++/OpenMP kernels on CPU, Triton on CUDA) of the whole model.

Attention is one opaque op (``attention_op.py``), so the graph holds everything else: embedding, per layer the fused
residual add + RMSNorm, the QKV projection, RoPE, the output projection, SiLU·mul and the MLP matmuls, the final norm
and the LM head over the sampled rows. Inductor fuses the pointwise and reduction work into a few C++ loops per layer
and calls the vendor GEMM (oneDNN/MKL) for the matmuls; what it removes is the per-op cost of the eager forward
(~30 layers x ~15 ops, each a dispatcher call and a pass over memory).

Buckets: the token and sequence counts are unbacked dynamic sizes (``mark_unbacked``), so ONE graph serves every
batch and chunk size, 1 included, with no padding (the CPU analogue of SGLang's CUDA-graph batch sizes collapses to a
single bucket). Plain dynamic sizes would specialise 1, making batch-1 decode and one-sequence prefill graphs of their
own: three compiles instead of one (measured on a tiny model: 3 graphs and ~90 s cold vs 1 graph and ~56 s, on a
loaded 2-core machine). ``--torch-compile-max-bs`` caps the sequences per forward that take the compiled path
(larger batches run eager, as in SGLang).

Artifacts (inductor's FX-graph and kernel caches) live under the user's cache dir (``compile_cache_dir``), keyed by
the thread count the kernels were built for, so a restart reuses them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "RADIXSERVE_COMPILE_CACHE_DIR"


def compile_cache_dir(explicit: str | None = None) -> Path:
    """Where compile artifacts go: ``explicit``, else ``$RADIXSERVE_COMPILE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/radixserve/torch-compile`` (``~/.cache/radixserve/torch-compile``)."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixserve" / "torch-compile"


def configure_compile_cache(cache_dir: Path, num_threads: int) -> Path:
    """Point inductor's caches at ``cache_dir/threads-N`` (created) before the first compile; returns that dir.

    Inductor bakes the OpenMP thread count into its C++ kernels, hence one subfolder per count: a one-thread engine
    never loads kernels built for two. Sets ``TORCHINDUCTOR_CACHE_DIR`` for this process (torch fills that variable
    with its /tmp default on import, so a value found there says nothing about the user's wish).
    """
    target = cache_dir / f"threads-{num_threads}"
    target.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(target)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    return target


ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CompiledForward:
    """``model.forward(input_ids, positions, logits_indices)`` compiled once with a dynamic token dimension.

    Args:
        forward: the eager forward (``LlamaForCausalLM.forward``).
        max_batch_size: forwards of more sequences run ``forward`` eagerly (``None``: every size runs compiled).
    """

    def __init__(self, forward: ForwardFn, max_batch_size: int | None = None) -> None:
        self.eager = forward
        self.max_batch_size = max_batch_size
        self._compiled: ForwardFn = torch.compile(forward, fullgraph=True, dynamic=None)

    def uses_compiled(self, batch_size: int) -> bool:
        """True when a forward of ``batch_size`` sequences runs the compiled graph."""
        return self.max_batch_size is None or batch_size <= self.max_batch_size

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Same contract as ``LlamaForCausalLM.forward``: float32 logits ``[batch, vocab]``."""
        if not self.uses_compiled(int(logits_indices.shape[0])):
            return self.eager(input_ids, positions, logits_indices)
        for t in (input_ids, positions, logits_indices):
            torch._dynamo.decorators.mark_unbacked(t, 0)
        return self._compiled(input_ids, positions, logits_indices)
