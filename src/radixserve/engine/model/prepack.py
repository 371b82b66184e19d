"""Weights prepacked for oneDNN, the CPU GEMM library: the decode-shaped matmuls at memory speed.

Why (measured with ``bench/decode_step.py``, see bench/README.md): ``F.linear`` on CPU reorders the weight into
oneDNN's blocked layout on every call (bf16), or runs MKL's small-M sgemm kernels (fp32), which for the 1-16 rows of
a decode step are several times slower than a GEMM over a weight already in the library's layout. Inductor does the
same prepacking under ``freezing`` (``torch/_inductor/fx_passes/mkldnn_fusion.py``: ``mkldnn._reorder_linear_weight``
+ ``mkldnn._linear_pointwise``), but only for weights that are graph constants; our compiled layer graph takes the
weights as inputs (one graph serves every layer, ``compile.py``), so the packing is done here, once, after loading.

A packed weight is an opaque oneDNN tensor that ``torch.compile`` cannot trace, so the matmul is one custom op,
``radixserve::packed_linear``, whose argument is a small int64 handle into this module's table of packed weights
(as ``radixserve::attention`` takes a layer index). The dense weight is then released: the packed copy is the only
one, so the projections' memory stays the same; a tied LM head adds a packed copy of the embedding. Which dtypes are
packed by default: ``prepack_pays`` (bfloat16 / float16; float32 measured slower packed at batch-1 decode here).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from radixserve.engine.model.batch_invariant import ROW_CHUNK, in_row_chunks

# The row-count hint oneDNN picks its blocking for: the batch-invariant chunk size, the shape deterministic mode runs.
PACK_ROWS_HINT = ROW_CHUNK

_packed: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
_next_handle = itertools.count()


def prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True when oneDNN can run prepacked GEMMs of ``dtype`` on ``device`` (CPU only; bf16 / fp16 need the CPU's
    native support, which oneDNN reports)."""
    if device.type != "cpu" or not torch._C._has_mkldnn:
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def prepack_pays(dtype: torch.dtype, device: torch.device) -> bool:
    """True where prepacking is the default (``--disable-weight-prepack`` off): bfloat16 / float16 where supported.

    Not float32: measured on an Intel Xeon (AVX-512, SmolLM2-135M, 2 threads), MKL's dense GEMV beat the packed GEMM
    at batch-1 decode (47 vs 58 ms per step) and a float32 engine's tests ran 17% slower packed; bfloat16 decode was
    faster packed (39.6 vs 55.8 ms per compiled step). ``ModelRunner(weight_prepack=True)`` still packs float32.
    """
    return dtype in (torch.bfloat16, torch.float16) and prepack_supported(dtype, device)


def pack_linear(owner: object, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Pack ``weight`` ``[out, in]`` (and keep ``bias`` ``[out]``) for ``packed_linear``; returns the handle, an int64
    0-d CPU tensor. The entry lives as long as ``owner`` (the module holding the handle)."""
    handle = next(_next_handle)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)
    _packed[handle] = (packed, None if bias is None else bias.contiguous())
    weakref.finalize(owner, _packed.pop, handle, None)
    return torch.tensor(handle, dtype=torch.int64)


def packed_bytes(handle: torch.Tensor) -> int:
    """Bytes of the packed weight and bias behind ``handle`` (the logical size; oneDNN may pad a little)."""
    weight, bias = _packed[int(handle.item())]
    size = weight.numel() * weight.element_size()
    return size + (0 if bias is None else bias.numel() * bias.element_size())


@torch.library.custom_op("radixserve::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, handle: torch.Tensor, out_features: int, batch_invariant: bool = False
) -> torch.Tensor:
    """``x @ W.T + b`` with the weight packed by ``pack_linear``: ``x`` ``[T, in]`` -> ``[T, out_features]``.

    ``batch_invariant``: run it in chunks of ``batch_invariant.ROW_CHUNK`` rows, so row ``i`` depends only on ``x[i]``
    (``--enable-deterministic-inference``). Raises KeyError for a handle whose module is gone.
    """
    weight, bias = _packed[int(handle.item())]

    def gemm(rows: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
        return out

    return in_row_chunks(gemm, x, out_features) if batch_invariant else gemm(x)


@packed_linear.register_fake
def _packed_linear_fake(
    x: torch.Tensor, handle: torch.Tensor, out_features: int, batch_invariant: bool = False
) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))
