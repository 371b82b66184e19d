"""Walk a GGUF file's header (metadata and tensor infos) without reading any tensor: how many bytes its tensors need.

A truncated download or a half-copied file otherwise fails deep inside gguf-py or transformers with "cannot reshape
array of size ..." or a bare ``struct.error``. The walk skips metadata values by their lengths (the 49k-string
tokenizer arrays of the demo model take ~30 ms), so ``locate.py`` can check a file before anything loads.

Layout (GGUF v2/v3, ggml's docs/gguf.md): magic ``GGUF``, u32 version, u64 tensor count, u64 metadata count; each
metadata entry a string key, u32 value type, value; each tensor info a string name, u32 n_dims, u64 dims, u32 GGML
type, u64 offset into the data section, which starts at the header's end rounded up to ``general.alignment`` (32).
Little-endian only (big-endian GGUF files are rare and are refused with a clear error).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

# GGUF metadata value types -> fixed sizes in bytes (8 = string, 9 = array are variable)
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class GGUFHeaderError(ValueError):
    """The file is not a complete, readable GGUF file; the message says what is wrong in one line."""


@dataclass(frozen=True)
class GGUFExtent:
    """What a GGUF file's header promises: ``needed_bytes`` = data-section start + the end of its last tensor."""

    version: int
    tensor_count: int
    needed_bytes: int
    file_bytes: int


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as e:
            raise GGUFHeaderError(f"truncated header (it ends at byte {len(self.buf)})") from e
        self.pos += struct.calcsize(fmt)
        return int(value)

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFHeaderError(f"truncated header (it ends at byte {len(self.buf)})")
        self.pos += n

    def string(self) -> bytes:
        n = self.take("<Q")
        self.skip(n)
        return bytes(self.buf[self.pos - n : self.pos])

    def skip_value(self, vtype: int) -> None:
        if vtype in _FIXED_SIZES:
            self.skip(_FIXED_SIZES[vtype])
        elif vtype == _STRING:
            self.skip(self.take("<Q"))
        elif vtype == _ARRAY:
            item_type, count = self.take("<I"), self.take("<Q")
            if item_type in _FIXED_SIZES:
                self.skip(_FIXED_SIZES[item_type] * count)
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        else:
            raise GGUFHeaderError(f"unknown metadata value type {vtype} at byte {self.pos}")


def read_gguf_extent(path: str) -> GGUFExtent:
    """Walk ``path``'s GGUF header and return its extent; reads only the header pages (memory-mapped).

    Raises:
        GGUFHeaderError: no GGUF magic, a version other than 2 or 3, a header cut short, an unknown metadata or GGML
            type. A complete header over missing tensor data is NOT an error here: compare ``needed_bytes`` with
            ``file_bytes`` (``check_gguf_complete``).
        OSError: the file cannot be opened or mapped.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise GGUFHeaderError("no GGUF magic")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise GGUFHeaderError(f"GGUF version {version} (supported: 2 and 3; a big-endian file?)")
        tensor_count, kv_count = cur.take("<Q"), cur.take("<Q")
        alignment = _DEFAULT_ALIGNMENT
        for _ in range(kv_count):
            key, vtype = cur.string(), cur.take("<I")
            if key == b"general.alignment" and vtype == 4:
                alignment = cur.take("<I") or _DEFAULT_ALIGNMENT
            else:
                cur.skip_value(vtype)
        data_end = 0
        for _ in range(tensor_count):
            name = cur.string().decode("utf-8", "replace")
            n_dims = cur.take("<I")
            elements = 1
            for _ in range(n_dims):
                elements *= cur.take("<Q")
            ggml_type, offset = cur.take("<I"), cur.take("<Q")
            try:
                block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError) as e:
                raise GGUFHeaderError(f"tensor {name}: unknown GGML type {ggml_type}") from e
            data_end = max(data_end, offset + elements // block * type_bytes)
        data_start = -(-cur.pos // alignment) * alignment
        return GGUFExtent(version, tensor_count, data_start + data_end, len(buf))


def check_gguf_complete(path: str) -> None:
    """Raise GGUFHeaderError unless ``path``'s header parses and the file holds every byte its tensors need."""
    extent = read_gguf_extent(path)
    if extent.file_bytes < extent.needed_bytes:
        raise GGUFHeaderError(
            f"truncated: its {extent.tensor_count} tensors need {extent.needed_bytes} bytes, the file has "
            f"{extent.file_bytes} (an interrupted download or copy?)"
        )
