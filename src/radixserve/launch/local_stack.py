"""``radixserve up``: the local stack — the router on 127.0.0.1:8000 in front of N engine processes on 30000, 30001...

Each engine is a child process (``python -m radixserve engine``) with its share of the CPU threads and its progress
bars off (two engines' bars would interleave on one terminal line); the router runs in this process with static
discovery of the engines' URLs. A supervisor thread restarts an engine that exits on its own (back-off 1 s doubling to
30 s, back to 1 s once an engine had stayed up 60 s), so killing one is a fault the router rides out (ejection, then
re-admission), not the end of the stack. An engine that never came up (it exited ``max_failed_starts`` = 3 times in a
row within its first 60 s: a model it cannot load, a port it cannot bind) ends the stack with exit status 1 instead
of being restarted forever behind a router answering 503. Ctrl-C / SIGTERM stops the router, then the engines
(SIGTERM, then SIGKILL after a grace period; a second Ctrl-C kills them at once).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from radixserve.engine.config import EngineArgs
    from radixserve.router.config import RouterArgs

logger = logging.getLogger("radixserve.up")

# Engine fields the stack sets per process; every other non-default engine flag is forwarded as given.
_PER_ENGINE_FIELDS = frozenset({"host", "port", "num_threads"})

# Environment of the engine children, unless set already: no progress bars (tqdm's own, huggingface_hub's, and
# transformers', which follow huggingface_hub's). Regression: the "Loading weights" bars of two engines interleaved
# on one terminal line and a supervisor warning got glued onto one. A standalone ``radixserve engine`` keeps them.
ENGINE_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def engine_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for an engine child: ``base`` (default: this process's) with ``ENGINE_ENV`` where unset."""
    return {**ENGINE_ENV, **(os.environ if base is None else base)}


def engine_argv(args: EngineArgs, port: int, num_threads: int) -> list[str]:
    """Command line for one engine child: ``python -m radixserve engine`` with every engine flag that differs from
    its default, plus this engine's port and thread count."""
    from radixserve.engine.config import EngineArgs

    argv = [
        sys.executable,
        "-m",
        "radixserve",
        "engine",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num-threads",
        str(num_threads),
    ]
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if f.name in _PER_ENGINE_FIELDS or value == getattr(defaults, f.name) or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):  # differs from its default: --flag, or --no-flag for a default-on switch
            argv.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


def check_ports_free(ports: list[tuple[str, int]]) -> None:
    """Raise ValueError unless every ``(host, port)`` is distinct and free to listen on. Regression: an engine port
    held by another process (another engine, a second ``make run``) was silently fronted by the router while our
    engine restarted forever failing to bind."""
    import socket

    seen: set[int] = set()
    for host, port in ports:
        if port in seen:
            raise ValueError(f"port {port} is given to two servers of the stack (router and engine ports must differ)")
        seen.add(port)
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
            try:
                s.bind((host, port))
            except OSError as e:
                raise ValueError(
                    f"port {port} on {host} is not free ({e.strerror}); stop what uses it or pick "
                    f"other ports (--port, --engine-base-port)"
                ) from e


def split_threads(total: int | None, engines: int) -> int:
    """Threads per engine: ``total`` (default: the CPUs this process may use) shared evenly, at least 1 each."""
    if total is None:
        total = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, total // engines)


def _die_with_parent() -> None:
    """In the child before exec: on Linux, get SIGTERM when the stack process dies, even by SIGKILL (no orphans)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class EngineSupervisor:
    """Starts the engine children and restarts any that exit while the stack runs.

    ``argvs[i]`` is engine i's command line, ``env`` the children's environment (default ``engine_env()``). An engine
    that exits is restarted after ``backoff_s``, doubling with each exit up to ``max_backoff_s``; an engine that had
    stayed up ``reset_after_s`` seconds before it exited starts over at ``backoff_s`` (regression: the back-off never
    reset, so after five crashes at any time every later one waited 30 s). ``poll_s``: how often exits are checked.

    An engine that exits before it stayed up ``reset_after_s`` seconds counts as a failed start (it never became
    healthy: with the demo model an engine is serving within seconds, so 60 s up means it came up; no health probe is
    needed). After ``max_failed_starts`` failed starts in a row (``None``: never) the supervisor gives up: it restarts
    no engine any more, sets ``failure`` to a one-line reason and calls ``on_give_up`` (from its thread;
    ``run_local_stack`` interrupts the router with it, to end the stack). An engine that had stayed up and then
    crashes is restarted as before. ``stop()`` sends SIGTERM to all, waits ``grace_s`` seconds, then kills.
    """

    def __init__(
        self,
        argvs: list[list[str]],
        grace_s: float = 15.0,
        *,
        env: Mapping[str, str] | None = None,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        reset_after_s: float = 60.0,
        poll_s: float = 0.5,
        max_failed_starts: int | None = 3,
        on_give_up: Callable[[], None] | None = None,
    ):
        self.argvs = argvs
        self.grace_s = grace_s
        self.env = engine_env() if env is None else dict(env)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.reset_after_s = reset_after_s
        self.poll_s = poll_s
        self.max_failed_starts = max_failed_starts
        self.on_give_up = on_give_up
        self.failure: str | None = None  # why the supervisor gave up on an engine; None while it has not
        self.failed_starts = [0] * len(argvs)  # engine i's failed starts in a row
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(argvs)
        self.backoff = [backoff_s] * len(argvs)  # engine i's next restart delay
        self._started_at = [0.0] * len(argvs)  # monotonic seconds when engine i's process was started
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="radixserve-supervisor", daemon=True)

    def start(self) -> None:
        for i in range(len(self.argvs)):
            self._spawn(i)
        self._thread.start()

    def _spawn(self, i: int) -> None:
        # Own process group: a terminal's Ctrl-C reaches only this process, which then stops the engines in order.
        proc = subprocess.Popen(self.argvs[i], start_new_session=True, preexec_fn=_die_with_parent, env=self.env)
        self.procs[i] = proc
        self._started_at[i] = time.monotonic()
        logger.info("engine %d started (pid %d): %s", i, proc.pid, " ".join(self.argvs[i][2:]))

    def _watch(self) -> None:
        # Each engine's restart is scheduled on its own, so one engine's long back-off delays neither the restart nor
        # the exit time (and so the back-off reset) of another.
        restart_at: list[float | None] = [None] * len(self.argvs)
        while not self._stopping.wait(self.poll_s):
            now = time.monotonic()
            for i, proc in enumerate(self.procs):
                if proc is None or proc.poll() is None:
                    continue
                due = restart_at[i]
                if due is None:
                    if now - self._started_at[i] >= self.reset_after_s:
                        self.backoff[i] = self.backoff_s  # it had stayed up: a new fault, not a crash loop
                        self.failed_starts[i] = 0
                    else:
                        self.failed_starts[i] += 1
                        gives_up = (
                            self.max_failed_starts is not None and self.failed_starts[i] >= self.max_failed_starts
                        )
                        if gives_up and not self._stopping.is_set():
                            self._give_up(i, proc.returncode)
                            return
                    delay = self.backoff[i]
                    logger.warning("engine %d exited with status %s; restarting in %g s", i, proc.returncode, delay)
                    restart_at[i] = now + delay
                    self.backoff[i] = min(delay * 2, self.max_backoff_s)
                elif now >= due and not self._stopping.is_set():
                    restart_at[i] = None
                    self._spawn(i)

    def _give_up(self, i: int, status: int | None) -> None:
        self.failure = (
            f"engine {i} failed to start {self.failed_starts[i]} times in a row; last exit status {status}; "
            f"see its output above"
        )
        logger.error("%s", self.failure)
        if self.on_give_up is not None:
            self.on_give_up()

    def stop(self) -> None:
        """Stop the engines: SIGTERM, then SIGKILL after ``grace_s``. A KeyboardInterrupt meanwhile (Ctrl-C again)
        kills the engines still running at once, waits for them, and propagates."""
        self._stopping.set()
        try:
            if self._thread.is_alive():
                self._thread.join(timeout=5)
            live = [p for p in self.procs if p is not None and p.poll() is None]
            for p in live:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            for p in live:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("engine pid %d did not stop in %.0f s; killing it", p.pid, self.grace_s)
                    p.kill()
                    p.wait()
        except KeyboardInterrupt:
            logger.warning("interrupted again: killing the engines")
            self._kill_all()
            raise

    def _kill_all(self) -> None:
        if self._thread.is_alive():  # a restart under way must not leave an engine behind
            self._thread.join(timeout=5)
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.kill()
        for p in self.procs:
            if p is not None:
                p.wait()


def run_local_stack(engine_args: EngineArgs, router_args: RouterArgs, engines: int, engine_base_port: int) -> int:
    """Run ``engines`` engine children on ``engine_base_port``, ``+1``, ... and the router (``router_args``, whose
    worker URLs are set here) in this process until Ctrl-C/SIGTERM. Returns the exit status."""
    from radixserve.engine.model.locate import check_model_paths
    from radixserve.router.app import run_router

    if engines < 1:
        raise ValueError("--engines must be at least 1")
    threads = split_threads(engine_args.num_threads, engines)
    ports = [engine_base_port + i for i in range(engines)]
    check_model_paths(engine_args.model_path, engine_args.tokenizer_path)  # here, not in N engines' restart loops
    check_ports_free([(router_args.host, router_args.port)] + [("127.0.0.1", p) for p in ports])
    # An engine that cannot start ends the stack: SIGINT to this process stops the router as Ctrl-C does.
    supervisor = EngineSupervisor(
        [engine_argv(engine_args, port, threads) for port in ports],
        on_give_up=lambda: os.kill(os.getpid(), signal.SIGINT),
    )
    router_args.worker_urls = [f"http://127.0.0.1:{port}" for port in ports]
    logger.info("starting %d engine(s) with %d thread(s) each on ports %s", engines, threads, ports)
    supervisor.start()
    try:
        status = run_router(router_args)
    except KeyboardInterrupt:
        if supervisor.failure is None:
            raise
        status = 1
    finally:
        supervisor.stop()
    if supervisor.failure is not None:
        print(f"radixserve up: {supervisor.failure}", file=sys.stderr)  # the last line, after the engines' output
        return 1
    return status
