"""How many token slots the KV cache pool gets: ``--max-total-tokens``, ``--mem-fraction-static`` or the default.

SGLang's meaning of ``--mem-fraction-static`` (srt/model_executor/model_runner.py ``profile_max_num_token``): the
fraction of the device's memory that the weights and the KV pool may take together, so

    KV pool bytes = fraction x memory - bytes in use after loading the weights

- CUDA: memory is the GPU's total memory and "in use" is everything already allocated on it (weights, the CUDA
  context, other processes), read with ``torch.cuda.mem_get_info`` after the load. Default fraction 0.9, as SGLang's.
- CPU: memory is the memory limit (``memory_limit_bytes``: the cgroup's limit, else MemTotal) and "in use" is the
  weights' bytes. Without either flag the pool is today's 2 GiB budget, at most 200k tokens, and never more than
  leaves weights + pool within ``CPU_DEFAULT_MEM_FRACTION`` of the memory limit (the rest is for the runtime,
  activations and the OS: a 3 GiB container must not get a 2 GiB pool on top of weights and overhead).

``--max-total-tokens`` wins when both flags are given. A pool that the memory (a fraction of it, given or default, or
the CPU default's limit) leaves too small for one full context (``context_length`` tokens) is a start-up error. The
CPU default's own 2 GiB / 200k budget is not: as before, a longer context than it holds is served with the context
cut to the pool (``Engine.context_length``). Pure Python (no torch): ``radixserve up`` and ``--help`` use it too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from dataclasses import dataclass

GiB = 1024**3
CUDA_DEFAULT_MEM_FRACTION = 0.9  # SGLang's default
CPU_KV_BUDGET_BYTES = 2 * GiB  # the default pool on CPU ...
CPU_MAX_TOTAL_TOKENS = 200_000  # ... at most this many tokens ...
CPU_DEFAULT_MEM_FRACTION = 0.6  # ... and weights + pool within this fraction of the memory limit


def format_bytes(n: float) -> str:
    """``2.0 GiB``, ``259 MiB``, ``22.5 KiB`` or ``256 B``, for log lines and errors."""
    if abs(n) >= GiB:
        return f"{n / GiB:.1f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 1024:.1f} KiB" if abs(n) >= 1024 else f"{n:.0f} B"


def _read_int(path: str) -> int | None:
    """The integer in a cgroup limit file; None for a missing file or ``max`` (no limit)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory_limit_bytes(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """The tightest memory limit of this process's cgroup and its ancestors, in bytes; None when there is none.

    cgroup v2: ``memory.max`` along the ``0::/path`` of ``/proc/self/cgroup``; v1: ``memory.limit_in_bytes`` under
    ``memory/`` along the memory controller's path (an unlimited v1 group reports ~2^63, larger than any machine, so
    the caller's ``min`` with MemTotal drops it). Inside a container the group is usually the root of the mount."""
    try:
        with open(os.path.join(proc_root, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, name = cgroup_root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(cgroup_root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the group itself, then each ancestor up to the root
            value = _read_int(os.path.join(base, *parts[:depth], name))
            if value is not None:
                limits.append(value)
    return min(limits) if limits else None


def mem_total_bytes(proc_root: str = "/proc") -> int:
    """MemTotal of ``/proc/meminfo`` in bytes. Raises OSError when it cannot be read."""
    with open(os.path.join(proc_root, "meminfo")) as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no MemTotal in {proc_root}/meminfo")


def process_rss_bytes(proc_root: str = "/proc") -> int | None:
    """This process's resident set size (VmRSS of ``/proc/self/status``) in bytes; None where it cannot be read."""
    try:
        with open(os.path.join(proc_root, "self", "status")) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def release_freed_memory() -> bool:
    """Hand the C heap's freed pages back to the OS (glibc ``malloc_trim(0)``, after a ``gc.collect``): loading
    parses files and builds temporaries, and glibc keeps the freed memory between live objects as resident (measured
    on the demo GGUF: 135 MiB of a 680 MiB process after the load). Returns False where the C library has no
    ``malloc_trim`` (musl, macOS); never raises."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def memory_limit_bytes(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The memory this process may use, in bytes: the cgroup limit when one is set, else MemTotal (the smaller)."""
    total = mem_total_bytes(proc_root)
    limit = cgroup_memory_limit_bytes(proc_root, cgroup_root)
    return total if limit is None else min(total, limit)


@dataclass(frozen=True)
class PoolSize:
    """The KV pool's usable token slots and, for the log, the rule that chose them."""

    tokens: int
    rule: str


def size_kv_pool(
    *,
    bytes_per_token: int,
    context_length: int,
    device_type: str,
    memory_bytes: int,
    used_bytes: int,
    max_total_tokens: int | None = None,
    mem_fraction_static: float | None = None,
) -> PoolSize:
    """Size the KV pool (module doc for the rule).

    Args:
        bytes_per_token: K+V bytes of one token over all layers.
        context_length: the longest sequence; the pool must hold one.
        device_type: ``cuda`` or ``cpu``.
        memory_bytes: the GPU's total memory (CUDA) or the memory limit (CPU).
        used_bytes: bytes in use after the load: all of the GPU's (CUDA), the weights' (CPU).
        max_total_tokens / mem_fraction_static: the flags (None: not given).

    Raises:
        ValueError: naming the flag, when the memory (the fraction, given or default, or the CPU default's limit)
            leaves less than one context of KV.
    """
    if max_total_tokens is not None:
        rule = f"--max-total-tokens {max_total_tokens}"
        if mem_fraction_static is not None:
            rule += f" (wins over --mem-fraction-static {mem_fraction_static})"
        return PoolSize(max_total_tokens, rule)
    memory = (
        f"the GPU's {format_bytes(memory_bytes)}"
        if device_type == "cuda"
        else f"the {format_bytes(memory_bytes)} memory limit"
    )
    in_use = "in use" if device_type == "cuda" else "of weights"
    fraction = mem_fraction_static
    flag = f"--mem-fraction-static {fraction}"
    if fraction is None and device_type == "cuda":
        fraction = CUDA_DEFAULT_MEM_FRACTION
        flag = f"--mem-fraction-static {fraction} (the default on CUDA)"
    if fraction is not None:
        pool = int(fraction * memory_bytes) - used_bytes
        tokens = pool // bytes_per_token
        explain = f"{flag}: {fraction} x {memory} - {format_bytes(used_bytes)} {in_use} = {format_bytes(pool)}"
        fix = "raise it, or lower --context-length, or give --max-total-tokens"
        cut_by_memory = True
    else:  # CPU default
        cap = int(CPU_DEFAULT_MEM_FRACTION * memory_bytes) - used_bytes
        budget = min(CPU_MAX_TOTAL_TOKENS, CPU_KV_BUDGET_BYTES // bytes_per_token)
        tokens = min(budget, cap // bytes_per_token)
        explain = (
            f"the default on CPU: at most {format_bytes(CPU_KV_BUDGET_BYTES)} and {CPU_MAX_TOTAL_TOKENS:,} tokens, "
            f"with weights + pool within {CPU_DEFAULT_MEM_FRACTION:.0%} of {memory} ({format_bytes(used_bytes)} of "
            f"weights leave {format_bytes(cap)})"
        )
        fix = "give --max-total-tokens or --mem-fraction-static, or lower --context-length"
        cut_by_memory = tokens < budget  # the memory limit, not the 2 GiB budget, set the size
    if tokens < context_length and cut_by_memory:
        need = context_length * bytes_per_token
        raise ValueError(
            f"KV pool too small: {explain}, less than one context ({context_length} tokens = "
            f"{format_bytes(need)}); {fix}"
        )
    return PoolSize(int(tokens), explain)
