"""Chained block hashes of a prompt: the one scheme the router keys on and the engine publishes its radix cache in.

A prompt's token ids are cut into blocks of ``block_tokens`` ids; block ``i`` (the ids ``[i*B, (i+1)*B)``) is named
by a chained hash (vLLM's prefix-caching block hash; GIE's prefix scorer)::

    h_0 = H(namespace)            namespace = JSON [kind, model, salt], compact, ASCII, e.g. ["tokens","m",null]
    h_i = H(h_{i-1} || block_i)   block_i = its ids as 4-byte unsigned little-endian integers

with ``H`` = blake2b with an 8-byte digest, so one hash names a whole prefix (the blocks before it included). The
wire form of a block hash is ``int.from_bytes(h_i, "little")``: an unsigned 64-bit integer, a JSON integer. Only full
blocks are hashed here; a partial last block never is.

``router/prefix_key.py`` keys requests with these functions and ``engine/memory/radix_cache.py`` publishes the
blocks it holds with them (``engine/memory/cache_events.py``), so router and engine agree by construction. Pure
Python, no wing, no torch.
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b
from typing import Any

# The engine endpoints that speak this scheme (docs/contracts.md, "Cache events and load (engine → router)").
ENGINE_CACHE_EVENTS_PATH = "/cache_events"  # GET ?since=SEQ: the radix cache's block events after SEQ
ENGINE_CACHE_SNAPSHOT_PATH = "/cache_snapshot"  # GET: every block the radix cache holds
ENGINE_PREFIX_BLOCKS_PATH = "/prefix_blocks"  # POST {"endpoint", "request"}: the engine's block hashes of a prompt
ENGINE_LOAD_PATH = "/load"  # GET: queue and running batch, in requests and KV tokens
EVENT_TYPES = ("stored", "removed", "cleared")  # an event's "type"

DIGEST_SIZE = 8  # bytes per digest: one block hash is an unsigned 64-bit integer
TOKEN_ID_BYTES = 4  # bytes per packed token id (vocabularies stay far below 2**32)
# 4-byte unsigned token ids: "I" is 4 bytes on every platform CPython runs on, "L" where it is not.
_ID_TYPECODE = "I" if array("I").itemsize == TOKEN_ID_BYTES else "L"
_BIG_ENDIAN = sys.byteorder == "big"


def digest(data: bytes) -> bytes:
    """``H(data)``: blake2b, an 8-byte digest."""
    return blake2b(data, digest_size=DIGEST_SIZE).digest()


def as_int(d: bytes) -> int:
    """The wire form of a digest: its 8 bytes read little-endian, an integer in ``[0, 2**64)``."""
    return int.from_bytes(d, "little")


def as_digest(block_hash: int) -> bytes:
    """The inverse of ``as_int``: the 8-byte digest of a block hash (to chain on from it)."""
    return block_hash.to_bytes(DIGEST_SIZE, "little")


def namespace_digest(kind: str, model: str, salt: Any = None) -> bytes | None:
    """``h_0`` of a key space: ``H`` of the JSON text of ``[kind, model, salt]`` (compact, ASCII), so no two namespaces
    share bytes. ``kind`` is ``"tokens"`` or ``"chars"`` (the router's character keys); ``salt`` is a request's
    ``cache_salt`` or None. None when ``salt`` is something JSON cannot carry (not from a real client)."""
    try:
        data = json.dumps([kind, model, salt], ensure_ascii=True, separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError):
        return None
    return digest(data.encode("ascii"))


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as the bytes that are hashed: 4-byte unsigned little-endian each, ``4 * len(token_ids)`` bytes.

    Raises TypeError (not integers) or OverflowError (negative, or 2**32 or more)."""
    packed = array(_ID_TYPECODE, token_ids)
    if _BIG_ENDIAN:
        packed.byteswap()  # the same hashes on every host
    return packed.tobytes()


def chain_packed(
    prev: bytes, packed: bytes, block_tokens: int, max_blocks: int | None = None
) -> tuple[list[int], bytes]:
    """Chain on from digest ``prev`` over the full blocks of ``packed`` (token ids as ``pack_token_ids`` makes them;
    a trailing partial block is ignored), at most ``max_blocks`` of them.

    Returns ``(hashes, last)``: the wire hash of each full block, in order, and the digest after the last one
    (``prev`` when there is none). One blake2b per block."""
    step = TOKEN_ID_BYTES * block_tokens
    n_full = len(packed) // step
    if max_blocks is not None:
        n_full = min(n_full, max_blocks)
    hashes: list[int] = []
    for off in range(0, n_full * step, step):
        prev = digest(prev + packed[off : off + step])
        hashes.append(as_int(prev))
    return hashes, prev


def extend_chain(prev: bytes, block_ids: Sequence[int]) -> bytes:
    """One chain step: the digest of the block of token ids ``block_ids`` after the digest ``prev``."""
    return digest(prev + pack_token_ids(block_ids))


def chain_block_hashes(h0: bytes, token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """The wire hashes of the ``len(token_ids) // block_tokens`` full blocks of a prompt whose namespace digest is
    ``h0`` (``namespace_digest``). Raises ValueError for ``block_tokens < 1`` and what ``pack_token_ids`` raises."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    n = len(token_ids) // block_tokens * block_tokens
    return chain_packed(h0, pack_token_ids(token_ids[:n]), block_tokens)[0]
