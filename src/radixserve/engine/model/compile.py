"""The compiled forward: ``torch.compile`` (inductor; C++/OpenMP kernels on CPU) of the decoder layer.

Attention is one opaque op (``attention_op.py``), so a layer's graph holds everything else: the residual add fused
with RMSNorm, the QKV projection, RoPE (and Qwen3's q/k norms), the output projection, SiLU·mul and the MLP matmuls.
Inductor fuses the pointwise and reduction work into a few C++ loops and calls the vendor GEMM (oneDNN/MKL) for the
matmuls; what goes is the per-op cost of the eager forward (~30 layers x ~15 ops, each a dispatcher call and a pass
over memory).

Regional compilation (PyTorch's recipe for repeated blocks): the layer is compiled, not the whole model, and every
layer runs the same graph (weights and the layer index are graph inputs), so a 30-layer model compiles two graphs
(the first layer, which has no residual yet, and the rest) instead of one 30-layer graph; a whole-model graph took
~6x longer to compile for the demo model. The embedding, the final norm and the LM head (a few ops) stay eager.

Buckets: the token count is an unbacked dynamic size (``mark_unbacked``), so one graph serves every batch and chunk
size, 1 included, with no padding (the CPU analogue of SGLang's CUDA-graph batch sizes collapses to one bucket).
Plain dynamic sizes would specialise 1, giving batch-1 decode and one-sequence prefill graphs of their own.
``--torch-compile-max-bs`` caps the sequences per forward that take the compiled path (larger batches run eager,
as in SGLang).

Artifacts (inductor's FX-graph, AOT and kernel caches) live under the user's cache dir (``compile_cache_dir``), keyed
by the thread count the kernels were built for, so a restart reuses them.
"""

from __future__ import annotations

import logging
import os
import types
from pathlib import Path

import torch

from radixserve.engine.model.llama import LlamaDecoderLayer

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


def _call_layer(
    layer: LlamaDecoderLayer, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    out: tuple[torch.Tensor, torch.Tensor] = layer(hidden, residual, positions)
    return out


def _own_layer_call() -> types.FunctionType:
    """A copy of ``_call_layer`` with its own code object.

    Dynamo keeps compiled graphs, and counts recompiles against ``recompile_limit``, per code object: with one shared
    function, every model loaded in a process (tests, a second runner) adds graphs to the same cache until the limit
    fails a ``fullgraph`` compile. One code object per ``CompiledLayers`` keeps each model's two graphs its own.
    """
    return types.FunctionType(_call_layer.__code__.replace(), _call_layer.__globals__, _call_layer.__name__)


class CompiledLayers:
    """Runs decoder layers through one ``torch.compile``-d graph (a ``LayerRunner`` for ``LlamaForCausalLM``).

    Args:
        max_batch_size: forwards of more sequences run eagerly (``None``: every size runs compiled).
    """

    def __init__(self, max_batch_size: int | None = None) -> None:
        self.max_batch_size = max_batch_size
        self._compiled = torch.compile(_own_layer_call(), fullgraph=True, dynamic=None)

    def uses_compiled(self, batch_size: int) -> bool:
        """True when a forward of ``batch_size`` sequences runs the compiled layers."""
        return self.max_batch_size is None or batch_size <= self.max_batch_size

    def __call__(
        self, layer: LlamaDecoderLayer, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer(hidden, residual, positions)``, compiled: ``(hidden, residual)``, each ``[num_tokens, hidden]``."""
        for t in (hidden, residual, positions):
            if t is not None:
                torch._dynamo.decorators.mark_unbacked(t, 0)
        out: tuple[torch.Tensor, torch.Tensor] = self._compiled(layer, hidden, residual, positions)
        return out
