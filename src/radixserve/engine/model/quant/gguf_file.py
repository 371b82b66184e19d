"""A GGUF file's tensors by name, memory-mapped (nothing is read until asked), typed as gguf-py's reader types them.

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


# GGML types gguf-py presents as typed numpy arrays; every other type is raw uint8 bytes (its reader's rule).
_NUMPY_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}  # fmt: skip


class GGUFFile:
    """The tensors and metadata of the GGUF file at ``path``, memory-mapped: nothing is read until asked.

    The header is walked by ``gguf_header.read_gguf_header`` (not gguf-py's ``GGUFReader``, which turns every metadata
    value into numpy views: 2-3 s and ~100 MiB of heap for a 49k-token vocabulary); tensor data are numpy arrays over
    one read-only map, shaped and typed as gguf-py's reader gives them, so ``gguf.quants.dequantize`` takes them.

    Raises FileNotFoundError; GGUFHeaderError (a ValueError) for a file that is not a complete GGUF file.
    """

    def __init__(self, path: str) -> None:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        from radixserve.engine.model.gguf_header import GGUFHeaderError, read_gguf_header

        self.path = path
        header = read_gguf_header(path, ("general.architecture",))
        if header.file_bytes < header.needed_bytes:
            raise GGUFHeaderError(f"{path}: truncated ({header.file_bytes} of {header.needed_bytes} bytes)")
        self._architecture = header.strings.get("general.architecture", "")
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self._tensors: dict[str, GGUFTensor] = {}
        for info in header.tensors:
            ggml_type = GGMLQuantizationType(info.ggml_type)
            shape = tuple(reversed(info.dims))  # torch order
            raw = self._map[info.offset : info.offset + info.nbytes]
            item = _NUMPY_TYPES.get(ggml_type.name)
            if item is not None:
                data = raw.view(item).reshape(shape)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(shape, ggml_type))
            self._tensors[info.name] = GGUFTensor(info.name, ggml_type.name, shape, data, ggml_type)

    @property
    def architecture(self) -> str:
        """``general.architecture`` (``llama``, ``qwen2``, ...)."""
        return self._architecture

    def names(self) -> list[str]:
        """Tensor names, in file order."""
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> GGUFTensor:
        """The tensor ``name``. Raises KeyError when the file has none."""
        return self._tensors[name]
