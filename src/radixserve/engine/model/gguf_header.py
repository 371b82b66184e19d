"""Walk a GGUF file's header (metadata and tensor infos) without reading any tensor: its tensors and their extent.

A truncated download or a half-copied file otherwise fails deep inside gguf-py or transformers with "cannot reshape
array of size ..." or a bare ``struct.error``. The walk skips metadata values by their lengths (the 49k-string
tokenizer arrays of the demo model take ~30 ms), so ``locate.py`` can check a file before anything loads and
``quant/gguf_file.py`` maps the tensors without gguf-py's reader (which builds a numpy view per metadata string: ~2-3 s
and ~100 MiB of heap on the demo model).

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
class GGUFTensorInfo:
    """One tensor's header entry: ``dims`` in GGML order (ne0 first, ``[K, N]`` for a linear weight), its GGML type
    id, and ``offset``/``nbytes`` of its data from the file's start, in bytes."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file's header says: its tensors, the string metadata values asked for, and ``needed_bytes`` =
    the end of its last tensor's data (a complete file has at least that many bytes)."""

    version: int
    tensors: tuple[GGUFTensorInfo, ...]
    strings: dict[str, str]
    needed_bytes: int
    file_bytes: int

    @property
    def tensor_count(self) -> int:
        """How many tensors the header lists."""
        return len(self.tensors)


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


def read_gguf_header(path: str, string_keys: tuple[str, ...] = ()) -> GGUFHeader:
    """Walk ``path``'s GGUF header; reads only the header pages (memory-mapped), never tensor data.

    ``string_keys``: metadata keys whose string values to return (e.g. ``general.architecture``); others are skipped.

    Raises:
        GGUFHeaderError: no GGUF magic, a version other than 2 or 3, a header cut short, an unknown metadata or GGML
            type, a duplicate tensor name. A complete header over missing tensor data is NOT an error here: compare
            ``needed_bytes`` with ``file_bytes`` (``check_gguf_complete``).
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
        strings: dict[str, str] = {}
        for _ in range(kv_count):
            key, vtype = cur.string().decode("utf-8", "replace"), cur.take("<I")
            if key == "general.alignment" and vtype == 4:
                alignment = cur.take("<I") or _DEFAULT_ALIGNMENT
            elif key in string_keys and vtype == _STRING:
                strings[key] = cur.string().decode("utf-8", "replace")
            else:
                cur.skip_value(vtype)
        entries: list[tuple[str, tuple[int, ...], int, int, int]] = []
        for _ in range(tensor_count):
            name = cur.string().decode("utf-8", "replace")
            dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
            ggml_type, offset = cur.take("<I"), cur.take("<Q")
            try:
                block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError) as e:
                raise GGUFHeaderError(f"tensor {name}: unknown GGML type {ggml_type}") from e
            elements = 1
            for d in dims:
                elements *= d
            entries.append((name, dims, ggml_type, offset, elements // block * type_bytes))
        data_start = -(-cur.pos // alignment) * alignment
        tensors = tuple(GGUFTensorInfo(n, d, t, data_start + o, b) for n, d, t, o, b in entries)
        if len({t.name for t in tensors}) != len(tensors):
            raise GGUFHeaderError("duplicate tensor names")
        needed = max((t.offset + t.nbytes for t in tensors), default=data_start)
        return GGUFHeader(version, tensors, strings, needed, len(buf))


def check_gguf_complete(path: str) -> None:
    """Raise GGUFHeaderError unless ``path``'s header parses and the file holds every byte its tensors need."""
    header = read_gguf_header(path)
    if header.file_bytes < header.needed_bytes:
        raise GGUFHeaderError(
            f"truncated: its {header.tensor_count} tensors need {header.needed_bytes} bytes, the file has "
            f"{header.file_bytes} (an interrupted download or copy?)"
        )
