"""The stack under soak (bench/soak.py): starting ``radixserve up``, finding its engine processes, faulting them, and
checking afterwards that nothing leaked.

Engines are found through the router (``GET /health`` lists their URLs) and each URL's process by the port it
listens on (``/proc/net/tcp``), so an already-running stack (``--url``) is faulted the same way as one the soak
started. ``radixserve up`` restarts an engine that exits (launch/local_stack.py ``EngineSupervisor``), but takes an
engine that exits 3 times in a row within 60 s of its start for a crash loop and stops the stack; ``Faults`` never
kills an engine a third time in a row before its process has been up ``CRASH_LOOP_S``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
CRASH_LOOP_S = 60.0  # launch/local_stack.py EngineSupervisor.reset_after_s
EARLY_KILLS_MAX = 2  # kills in a row within CRASH_LOOP_S of a start; the supervisor gives up at 3
_TCK = os.sysconf("SC_CLK_TCK")


def start_up(port: int, engine_base_port: int, engines: int, max_total_tokens: int, body_limit: int, log: Path) -> Any:
    """``python -m radixserve up`` on ``port`` (its own process group, output to ``log``); the Popen."""
    cmd = [sys.executable, "-m", "radixserve", "up", "--port", str(port), "--engine-base-port", str(engine_base_port)]
    cmd += ["--engines", str(engines), "--max-total-tokens", str(max_total_tokens)]
    cmd += ["--max-request-body-bytes", str(body_limit), "--shutdown-timeout", "10"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_up(proc: Any, timeout_s: float = 60) -> int | None:
    """SIGTERM (a drain), then SIGKILL to the group after ``timeout_s``; the exit status (None: killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return int(proc.wait(timeout_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
    return int(proc.returncode)


def workers(url: str) -> list[dict[str, Any]]:
    """The router's workers (``GET /health``; 503 still has the body)."""
    r = httpx.get(url + "/health", timeout=10)
    out: list[dict[str, Any]] = r.json()["workers"]
    return out


def all_routable(url: str) -> bool:
    """Every worker of the router ``healthy`` (``probing`` is on trial)."""
    try:
        ws = workers(url)
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    return bool(ws) and all(w["state"] == "healthy" and not w.get("draining") for w in ws)


def wait_until(cond: Callable[[], bool], timeout_s: float, poll_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def _listen_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                        inodes.add(cols[9])
        except OSError:
            continue
    return inodes


def pid_listening(port: int) -> int | None:
    """The process that listens on ``port`` (of those sharing the socket, the one whose parent does not)."""
    inodes = {f"socket:[{i}]" for i in _listen_inodes(port)}
    holders = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                holders.add(int(pid))
        except OSError:
            continue
    roots = [p for p in holders if _stat(p).get("ppid") not in holders]
    return min(roots) if roots else None


def _stat(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return {}
    return {"ppid": int(fields[1]), "start_ticks": int(fields[19])}


def uptime_s(pid: int) -> float:
    """Seconds since ``pid`` started."""
    with open("/proc/uptime") as f:
        now = float(f.read().split()[0])
    return now - _stat(pid).get("start_ticks", 0) / _TCK


def engine_port(url: str) -> int:
    m = re.search(r":(\d+)/?$", url)
    assert m, url
    return int(m.group(1))


@dataclass
class Faults:
    """Faults one engine at a time while the others serve: ``kind`` ``kill`` (SIGKILL), ``stop`` (SIGSTOP for
    ``stop_s`` seconds, then SIGCONT) or ``both`` (alternating, stop first). Engines take turns, so that with ``both``
    each engine is stopped and killed. A fault waits until every engine is healthy in the router again (at most
    ``recover_s``), so one engine always serves."""

    url: str
    kind: str
    stop_s: float
    recover_s: float = 180.0
    log: Callable[[str], None] = print
    injected: list[dict[str, Any]] = field(default_factory=list)
    not_recovered: list[str] = field(default_factory=list)
    early_kills: dict[str, int] = field(default_factory=dict)
    stopped: int | None = None  # the pid stopped right now
    ended: threading.Event = field(default_factory=threading.Event)  # the soak is over: no more faults

    def inject(self, t: float) -> None:
        """One fault at soak second ``t``, once every engine is healthy; a stop lasts ``stop_s`` (or to ``ended``)."""
        if not wait_until(lambda: self.ended.is_set() or all_routable(self.url), self.recover_s):
            self.not_recovered.append(f"at {t:.0f} s an engine was not healthy {self.recover_s:g} s after a fault")
            return
        if self.ended.is_set():
            return
        ws, k = workers(self.url), len(self.injected)
        target = ws[(k + k // 2) % len(ws)]["url"]  # with 2 engines and both kinds, each engine gets each kind
        pid = pid_listening(engine_port(target))
        if pid is None:
            self.not_recovered.append(f"no process listens for {target}")
            return
        kind = self.kind if self.kind != "both" else ("stop", "kill")[len(self.injected) % 2]
        up = uptime_s(pid)
        if kind == "kill":
            early = self.early_kills.get(target, 0) + 1 if up < CRASH_LOOP_S else 0
            if early > EARLY_KILLS_MAX:
                kind = "stop"  # a third quick kill would stop `up` (crash loop), a fault of the soak's own making
            else:
                self.early_kills[target] = early
        fault = {"t": round(t, 1), "kind": kind, "engine": target, "pid": pid, "uptime_s": round(up, 1)}
        self.log(f"fault: {fault}")
        self.injected.append(fault)
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
            return
        os.kill(pid, signal.SIGSTOP)
        self.stopped = pid
        self.ended.wait(self.stop_s)
        self.resume()

    def resume(self) -> None:
        """SIGCONT the stopped engine, if any."""
        if self.stopped is not None:
            try:
                os.kill(self.stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.stopped = None


# Counts that must be back at 0 (their baseline on an idle engine) once the soak is over.
LOAD_KEYS = ("queued_requests", "queued_prefill_tokens", "running_requests", "running_tokens")
METRIC_GAUGES = ("num_running_reqs", "num_queue_reqs", "num_grammar_queue_reqs")


def engine_counts(engine_url: str) -> dict[str, float]:
    """An engine's load (``GET /load``) and gauges (``GET /metrics``): what a leak would keep above 0. ``kv_held``
    is used minus evictable KV tokens (what the radix cache may not free)."""
    load = httpx.get(engine_url + "/load", timeout=10).json()
    out: dict[str, float] = {k: load[k] for k in LOAD_KEYS}
    metrics = {}
    for line in httpx.get(engine_url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"radixserve_engine_(\w+)\{[^}]*\} (\S+)$", line)
        if m:
            metrics[m.group(1)] = float(m.group(2))
    for g in METRIC_GAUGES:
        out[g] = metrics.get(g, 0.0)
    out["kv_held"] = metrics.get("num_used_tokens", 0.0) - metrics.get("num_evictable_tokens", 0.0)
    return out


def leaks(url: str, baseline: dict[str, dict[str, float]], settle_s: float = 30.0) -> dict[str, Any]:
    """What stays above its baseline on each engine and in the router once idle (waited for up to ``settle_s``):
    ``{}`` when nothing leaked. A restarted engine's baseline is 0 throughout."""
    found: dict[str, Any] = {}

    def clean() -> bool:
        found.clear()
        try:
            ws = workers(url)
            for w in ws:
                if w["inflight_requests"] or w["inflight_tokens"]:
                    found[f"router:{w['url']}"] = {k: w[k] for k in ("inflight_requests", "inflight_tokens")}
                base = baseline.get(w["url"], {})
                counts = engine_counts(w["url"])
                over = {k: v for k, v in counts.items() if v > base.get(k, 0.0)}
                if over:
                    found[w["url"]] = over
        except (httpx.HTTPError, ValueError, KeyError) as e:
            found["error"] = f"{type(e).__name__}: {e}"
        return not found

    wait_until(clean, settle_s, poll_s=1.0)
    return dict(found)
