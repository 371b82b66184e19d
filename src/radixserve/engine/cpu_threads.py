"""Pin the engine's OpenMP threads one per core, as vLLM's CPU backend does (``VLLM_CPU_OMP_THREADS_BIND``).

A decode step is hundreds of short parallel regions; each ends at a barrier where the team waits for its slowest
thread. Unbound, the kernel may put two of the team on one core or move one away from its warm caches; bound, each
thread keeps its core. Binding is done from Python: the engine thread spawns its OpenMP team with one parallel op,
the team's new thread ids are read from ``/proc/self/task``, and each thread (the engine thread included, as the
team's master) is pinned with ``sched_setaffinity``. It must run before any other parallel op on that thread, that
is first thing in ``ModelRunner``.

``--cpu-omp-threads-bind``: ``auto`` binds when the engine's thread count equals the CPUs it may run on (a pod with
dedicated cores, one engine per machine, or ``radixserve up``, which gives each engine its own CPUs); ``nobind``
never binds; a list such as ``0-1`` or ``0,2`` binds to those CPUs, one thread each.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

BIND_ENV = "RADIXSERVE_CPU_OMP_THREADS_BIND"


def parse_cpu_list(spec: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]`` (Linux cpuset syntax). Raises ValueError for anything else or a repeat."""
    cpus: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{spec!r} is not a CPU list such as 0-1 or 0,2")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{spec!r}: range {part} runs backwards")
        cpus.extend(range(first, last + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{spec!r} names a CPU twice")
    return cpus


def check_bind_spec(spec: str) -> None:
    """Raise ValueError for a ``--cpu-omp-threads-bind`` value that is not auto, nobind or a CPU list."""
    if spec not in ("auto", "nobind"):
        parse_cpu_list(spec)


def resolve_bind(spec: str, num_threads: int) -> list[int] | None:
    """The CPUs to bind ``num_threads`` threads to, or None for no binding (see the module docstring).

    Raises ValueError: a CPU list whose length is not ``num_threads`` or that names a CPU this process may not use.
    """
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "nobind":
        return None
    if spec == "auto":
        return allowed if len(allowed) == num_threads else None
    cpus = parse_cpu_list(spec)
    if len(cpus) != num_threads:
        raise ValueError(f"--cpu-omp-threads-bind {spec} names {len(cpus)} CPUs for {num_threads} threads")
    if not set(cpus) <= set(allowed):
        raise ValueError(f"--cpu-omp-threads-bind {spec}: this process may only run on CPUs {allowed}")
    return cpus


def _task_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def bind_omp_threads(cpus: list[int]) -> dict[int, int]:
    """Set ``len(cpus)`` intra-op threads and pin this thread and its OpenMP team one per CPU; ``{thread id: cpu}``.

    Call on the thread that will run every torch op, before any other parallel op there (its team must not exist
    yet). When the team's threads cannot be told apart (it existed already, or another thread started meanwhile)
    nothing is pinned and a WARNING says so. Raises OSError from ``sched_setaffinity`` for a CPU not allowed.
    """
    torch.set_num_threads(len(cpus))
    me = threading.get_native_id()
    if len(cpus) == 1:
        os.sched_setaffinity(0, {cpus[0]})  # 0: the calling thread
        return {me: cpus[0]}
    before = _task_ids()
    torch.empty(1 << 22).fill_(1.0)  # a parallel region: libgomp starts this thread's team now
    workers = sorted(_task_ids() - before)
    if len(workers) != len(cpus) - 1:
        logger.warning(
            "OpenMP threads not bound: expected %d new team threads, found %d (the team existed already?)",
            len(cpus) - 1,
            len(workers),
        )
        return {}
    placement = {me: cpus[0], **dict(zip(workers, cpus[1:]))}
    for tid, cpu in placement.items():
        os.sched_setaffinity(tid if tid != me else 0, {cpu})
    return placement
