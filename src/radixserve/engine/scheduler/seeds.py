"""Per-sample random streams of seeded requests."""

from __future__ import annotations

import hashlib

import torch


def sample_seed(seed: int, index: int) -> int:
    """The torch seed of sample ``index`` of a request seeded with ``seed``: the first 8 bytes of
    ``blake2b(f"{seed}:{index}")``, as an unsigned 64-bit integer.

    A hash, not ``seed + index``: with the sum, sample ``i`` of seed ``s + 1`` repeated sample ``i + 1`` of seed ``s``.
    Deterministic across runs and processes (no ``hash()``, which is salted per process), so the same seed and ``n``
    give the same samples. Raises TypeError for a seed that is not an int (validation should have caught it; the
    scheduler then fails that request alone).
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def sample_generator(seed: int | None, index: int, device: torch.device | str) -> torch.Generator | None:
    """The generator of sample ``index`` of a request seeded with ``seed`` (``sample_seed``), None when unseeded."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(sample_seed(seed, index))
