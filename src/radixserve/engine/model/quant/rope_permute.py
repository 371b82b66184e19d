"""The row order that undoes llama.cpp's permutation of the q and k projections.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders each head's rows of ``attn_q`` /
``attn_k`` from HF's rotate-half RoPE layout (first half, second half of the head dim) to GGML's interleaved pairs:
``w.reshape(n_head, 2, D / 2, K).swapaxes(1, 2)``. transformers' GGUF loader undoes it on the dequantized matrix
(``modeling_gguf_pytorch_utils.py``, ``LlamaTensorProcessor._reverse_permute_weights``): ``w.reshape(n_head, D / 2,
2, K).swapaxes(2, 1).reshape(N, K)``, with ``n_head`` the kv head count for ``attn_k``, only for GGUF files of
architecture ``llama`` (Mistral's included). That is a pure row permutation, so it applies to quantized rows with their
scales, exactly (``Int4Affine.rows``).
"""

from __future__ import annotations

import torch

# GGUF architectures whose q/k rows llama.cpp permutes (transformers' TENSOR_PROCESSORS maps only "llama" to it).
PERMUTED_ARCHITECTURES = ("llama",)


def reverse_rope_permutation(num_rows: int, num_heads: int) -> torch.Tensor:
    """int64 ``[num_rows]``: ``W_hf = W_gguf[index]`` for ``attn_q`` (``num_heads`` the attention heads) or
    ``attn_k`` (``num_heads`` the kv heads), as transformers' ``_reverse_permute_weights``.

    Raises ValueError when ``num_rows`` is not ``num_heads`` times an even head dim.
    """
    if num_heads < 1 or num_rows % (2 * num_heads):
        raise ValueError(f"{num_rows} rows are not {num_heads} heads of an even head dim")
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(-1)
