"""A GGUF file's tensors by name, through gguf-py's ``GGUFReader`` (memory-mapped: nothing is read until asked).

GGUF lists a tensor's shape ne0 first (``[K, N]`` for a linear weight); here every shape is in torch's order
(``[N, K]``), and a quantized tensor's raw data is its rows of GGML blocks, uint8 ``[N, K / 32 * block_bytes]``
(``ggml_blocks.py``). Tensor names are llama.cpp's (``blk.N.attn_q.weight``); ``hf_name`` maps them to HF's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# llama.cpp tensor names of the Llama family -> HF names (gguf-py's tensor_mapping.py, reversed, for our modules)
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL = re.compile(r"(\w+)\.(weight|bias)")
_SKIPPED = ("rope_freqs.weight",)  # llama3 RoPE factors: our RoPE computes them from the config


class UnsupportedGGUFType(ValueError):
    """A GGUF tensor of a GGML type this path cannot serve as stored; the message names the tensor and the type."""


def hf_name(gguf_name: str) -> str | None:
    """HF's name for a llama.cpp tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``);
    None for tensors the model does not use (``rope_freqs.weight``). Raises KeyError for an unknown name."""
    if gguf_name in _SKIPPED:
        return None
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    m = _GLOBAL.fullmatch(gguf_name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise KeyError(f"GGUF tensor {gguf_name!r} has no counterpart in the Llama-family model")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``name`` (llama.cpp's), ``type_name`` (GGML's: ``Q4_1``, ``F32``, ...), ``shape`` in torch order
    (``[N, K]``), ``data`` the memory-mapped numpy array as gguf-py gives it."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray
    _type: Any

    def raw_rows(self) -> torch.Tensor:
        """uint8 ``[N, bytes per row]``: the GGML blocks, copied out of the map. Raises ValueError for a 1-D
        tensor."""
        if len(self.shape) != 2:
            raise ValueError(f"{self.name} is not a matrix: shape {self.shape}")
        return torch.from_numpy(np.array(self.data, dtype=np.uint8).reshape(self.shape[0], -1))

    def dequantize(self) -> torch.Tensor:
        """float32 ``shape``: gguf-py's ``gguf.quants.dequantize`` (the reference values of any GGML type it knows).

        Raises UnsupportedGGUFType when gguf-py cannot dequantize the type."""
        from gguf.quants import dequantize

        try:
            values = dequantize(self.data, self._type)
        except NotImplementedError as e:
            raise UnsupportedGGUFType(f"{self.name}: GGML type {self.type_name} cannot be dequantized ({e})") from e
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(self.shape))


class GGUFFile:
    """The tensors and metadata of the GGUF file at ``path`` (raises FileNotFoundError, or gguf-py's ValueError for
    a file that is not GGUF)."""

    def __init__(self, path: str) -> None:
        from gguf import GGUFReader

        self.path = path
        self._reader = GGUFReader(path, "r")
        self._tensors = {t.name: t for t in self._reader.tensors}

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``llama``, ``qwen2``, ...)."""
        field = self._reader.fields["general.architecture"]
        return str(field.contents())

    def names(self) -> list[str]:
        """Tensor names, in file order."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> GGUFTensor:
        """The tensor ``name``. Raises KeyError when the file has none."""
        t = self._tensors[name]
        shape = tuple(int(s) for s in reversed(t.shape))
        return GGUFTensor(t.name, t.tensor_type.name, shape, t.data, t.tensor_type)
