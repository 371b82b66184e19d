"""What the bench scripts share: the filler vocabulary of their synthetic prompts, a stderr progress logger and a
free-port finder and the machine's CPU facts. Imported as ``_common`` (each script puts bench/ on ``sys.path``)."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

# Words the synthetic system prompts and user turns are drawn from (real tokens, so prompt lengths are realistic).
VOCAB = (
    "policy customer account refund shipping order product warranty support escalate verify identity respond "
    "politely concise accurate never promise always confirm details summary steps troubleshoot device network "
    "reset password billing invoice schedule appointment language tone empathy"
).split()


def make_log(script: str) -> Callable[[str], None]:
    """A ``log(msg)`` writing ``[bench/<script> HH:MM:SS] msg`` to stderr (stdout carries the results)."""

    def log(msg: str) -> None:
        print(f"[bench/{script} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def free_port(consecutive: int = 1) -> int:
    """A port p on 127.0.0.1 such that p .. p+consecutive-1 are free now. Raises RuntimeError after 100 tries."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        socks = []
        try:
            for p in range(port, port + consecutive):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def cpu_info() -> dict[str, Any]:
    """CPU model, flags and usable cores from /proc/cpuinfo and the affinity mask."""
    model, flags = "unknown", list[str]()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.split()
    isa = {k: k in flags for k in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")}
    return {"cpu_model": model, "cores": len(os.sched_getaffinity(0)), "isa": isa, "flags": " ".join(flags)}
