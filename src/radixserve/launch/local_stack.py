"""``radixserve up``: the local stack — the router on 127.0.0.1:8000 in front of N engine processes on 30000, 30001...

Each engine is a child process (``python -m radixserve engine``) with its share of the CPU threads and its progress
bars off (two engines' bars would interleave on one terminal line); the router runs in this process with static
discovery of the engines' URLs. Every line the stack writes is tagged with the process that wrote it (``router | ``,
``engine-0 | ``, ...; ``tagged_output.py`` says how). The API key (``--api-key``, default ``$RADIXSERVE_API_KEY``)
reaches the engines in their environment as ``RADIXSERVE_API_KEY``, never on their command line (visible in ``ps``)
nor in a log line. A supervisor thread restarts an engine that exits on its own (back-off 1 s doubling to
30 s, back to 1 s once an engine had stayed up 60 s), so killing one is a fault the router rides out (ejection, then
re-admission), not the end of the stack. An engine that never came up (it exited ``max_failed_starts`` = 3 times in a
row within its first 60 s: a model it cannot load, a port it cannot bind) ends the stack with exit status 1 instead
of being restarted forever behind a router answering 503. Ctrl-C / SIGTERM drains the stack (docs/contracts.md,
"Graceful drain"): the router stops admitting at once (503s), its requests in flight finish for up to
``--shutdown-timeout`` seconds (the rest then end with an error), then the engines stop (SIGTERM, then SIGKILL after
a grace period). A second Ctrl-C ends the router's requests at once and the engines get the short grace of an
immediate stop; Ctrl-C once more while they stop kills them. A stop asked for that way, once everything stopped, is
exit status 0 (regression: 130, which ``make run`` reported as "Error 130").
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

from radixserve.contracts import constants
from radixserve.engine.config import API_KEY_ENV
from radixserve.launch.tagged_output import ROUTER_TAG, TaggedOutput, engine_tag

if TYPE_CHECKING:  # pragma: no cover
    from radixserve.engine.config import EngineArgs
    from radixserve.router.config import RouterArgs

logger = logging.getLogger("radixserve.up")

# Engine fields the stack sets per process; every other non-default engine flag is forwarded as given.
_PER_ENGINE_FIELDS = frozenset({"host", "port", "num_threads", "cpu_omp_threads_bind"})
# Engine fields that go to the engines in their environment, never on their command line (``ps`` shows the key to
# all; the shutdown timeout is the router's, given as RADIXSERVE_SHUTDOWN_TIMEOUT by ``engine_env``).
_ENV_FIELDS = frozenset({"api_key", "shutdown_timeout"})
# Engine fields always on the command line: the CLI's default (demo://) differs from EngineArgs' (regression: `up
# --model-path models/smollm2-135m-instruct`, equal to EngineArgs' default, reached the engines as no flag at all).
_ALWAYS_FIELDS = frozenset({"model_path"})

# Environment of the engine children, unless set already: no progress bars (tqdm's own, huggingface_hub's, and
# transformers', which follow huggingface_hub's). Regression: the "Loading weights" bars of two engines interleaved
# on one terminal line and a supervisor warning got glued onto one. A standalone ``radixserve engine`` keeps them.
# PYTHONUNBUFFERED: an engine's stdout is a pipe to the supervisor (tagged_output.py), which Python would otherwise
# block-buffer, so its lines would come late and out of order with its stderr's.
ENGINE_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONUNBUFFERED": "1"}
# Seconds an engine may take to stop after SIGTERM beyond its own drain (--shutdown-timeout) before it is killed; and
# all it gets after a second Ctrl-C (the stop asked for at once).
ENGINE_STOP_GRACE_S = 15.0


def engine_env(
    base: Mapping[str, str] | None = None, api_key: str | None = None, shutdown_timeout: float | None = None
) -> dict[str, str]:
    """The environment for an engine child: ``base`` (default: this process's) with ``ENGINE_ENV`` where unset, and
    ``RADIXSERVE_API_KEY`` set to ``api_key`` (removed when it is None or empty: the engines then require no key, as
    the router in front of them). ``shutdown_timeout`` (seconds) is set as ``RADIXSERVE_SHUTDOWN_TIMEOUT``, the
    default of the engine's ``--shutdown-timeout`` (docs/contracts.md, "Graceful drain"), when given."""
    env = {**ENGINE_ENV, **(os.environ if base is None else base)}
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    if shutdown_timeout is not None:
        env[constants.SHUTDOWN_TIMEOUT_ENV] = f"{shutdown_timeout:g}"
    return env


def engine_argv(args: EngineArgs, port: int, num_threads: int, cpus: str = "nobind") -> list[str]:
    """Command line for one engine child: ``python -m radixserve engine`` with every engine flag that differs from
    its default, plus this engine's port, thread count and ``--cpu-omp-threads-bind`` (``cpus``); never
    ``--api-key`` (``engine_env`` carries the key)."""
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
        "--cpu-omp-threads-bind",
        cpus,
    ]
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if f.name in _PER_ENGINE_FIELDS | _ENV_FIELDS or value is None:
            continue
        if value == getattr(defaults, f.name) and f.name not in _ALWAYS_FIELDS:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):  # differs from its default: --flag, or --no-flag for a default-on switch
            argv.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


# ---- engine sizing: N engines, the router and their runtimes must fit the memory limit together
# Measured with the demo model on CPU (RSS): an engine's runtime (Python, torch, tokenizer, activations) is ~0.55 GiB
# beyond its weights and KV pool; the router in this process ~0.16 GiB (no torch). Kept with room on top.
ENGINE_RUNTIME_BYTES = 640 * 2**20
ROUTER_RESERVE_BYTES = 768 * 2**20


def model_weight_bytes(model_path: str) -> int:
    """The model's weight files on disk in bytes (``*.safetensors`` of a directory, or a ``.gguf`` file): an upper
    bound of the weights in memory for the fp32/bf16 checkpoints the engine loads (it may load them at half size)."""
    import glob

    if os.path.isfile(model_path):
        return os.path.getsize(model_path)
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(model_path, "*.safetensors")))


def engine_mem_fraction(memory_limit_bytes: int, engines: int, weight_bytes: int) -> float | None:
    """Each engine's ``--mem-fraction-static`` so that ``engines`` engines fit ``memory_limit_bytes`` together, or
    None when the engine's own default fits (its 2 GiB pool plus weights within each engine's share).

    Each engine's share of weights + KV pool is (limit - ``ROUTER_RESERVE_BYTES`` - engines x
    ``ENGINE_RUNTIME_BYTES``) / engines; the fraction returned is that share over the limit (3 decimals, rounded
    down), since the engine computes its pool as fraction x limit - weights (engine/memory/sizing.py). Raises
    ValueError when a share cannot even hold the weights."""
    from radixserve.engine.memory.sizing import CPU_KV_BUDGET_BYTES

    share = (memory_limit_bytes - ROUTER_RESERVE_BYTES - engines * ENGINE_RUNTIME_BYTES) // engines
    if share >= weight_bytes + CPU_KV_BUDGET_BYTES:
        return None
    if share <= weight_bytes:
        raise ValueError(
            f"the memory limit ({memory_limit_bytes / 2**30:.1f} GiB) is too small for {engines} engine(s) of this "
            f"model ({weight_bytes / 2**20:.0f} MiB of weights each, plus ~{ENGINE_RUNTIME_BYTES // 2**20} MiB of "
            f"runtime, plus the router): use fewer --engines"
        )
    return int(1000 * share / memory_limit_bytes) / 1000


def _engines_run_on_cpu(device: str) -> bool:
    """Whether the engines will size their pools from host memory: ``--device cpu``, or ``auto`` on a machine
    without an NVIDIA GPU device node (checked without importing torch, which the router process does not need)."""
    import glob

    return device == "cpu" or (device == "auto" and not glob.glob("/dev/nvidia[0-9]*"))


def size_engines(args: EngineArgs, engines: int, memory_limit_bytes: int | None = None) -> EngineArgs:
    """``args`` for each of the ``engines`` engines of the stack, with a smaller KV pool where the default would not
    fit: ``--mem-fraction-static`` from ``engine_mem_fraction`` (``memory_limit_bytes``: default this machine's,
    the cgroup limit else MemTotal). A user's ``--max-total-tokens`` is kept as given; a user's
    ``--mem-fraction-static`` is each engine's own (as for SGLang servers sharing a device) and is refused when the
    engines together would take all the memory. GPU engines keep their own sizing (a fraction of the GPU's memory).
    Raises ValueError naming the flag."""
    from radixserve.engine.memory.sizing import memory_limit_bytes as host_memory_limit_bytes

    if args.max_total_tokens is not None:
        return args
    if args.mem_fraction_static is not None:
        if engines * args.mem_fraction_static >= 1:
            raise ValueError(
                f"--mem-fraction-static {args.mem_fraction_static} is each engine's share of the memory: "
                f"{engines} engines would take {engines * args.mem_fraction_static:g} of it; give less than "
                f"{1 / engines:g}"
            )
        return args
    if not _engines_run_on_cpu(args.device):
        return args
    limit = host_memory_limit_bytes() if memory_limit_bytes is None else memory_limit_bytes
    fraction = engine_mem_fraction(limit, engines, model_weight_bytes(args.model_path))
    if fraction is None:
        return args
    logger.info(
        "memory limit %.1f GiB for %d engines: each gets --mem-fraction-static %s (weights + KV pool)",
        limit / 2**30,
        engines,
        fraction,
    )
    return dataclasses.replace(args, mem_fraction_static=fraction)


def describe_exit(status: int | None) -> str:
    """How a child ended, in words: ``exited with status 1``, or ``was killed by SIGKILL`` for the negative
    ``returncode`` subprocess gives a child ended by a signal. Regression: a SIGKILLed engine read "exited with
    status -9"."""
    if status is not None and status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def check_engine_ports(engines: int, base_port: int) -> None:
    """Raise ValueError naming the flag unless ``engines`` >= 1 and every engine port ``base_port`` ...
    ``base_port + engines - 1`` is a TCP port (1-65535). Regression: ``--engine-base-port 65535`` crashed with a
    traceback (OverflowError from bind) in the port check."""
    if engines < 1:
        raise ValueError(f"--engines must be at least 1, got {engines}")
    last = base_port + engines - 1
    if base_port < 1 or last > 65535:
        raise ValueError(
            f"--engine-base-port {base_port} with --engines {engines} needs ports {base_port}-{last}; "
            "engine ports must lie within 1-65535"
        )


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


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, sorted (all of ``os.cpu_count()`` where affinity is not exposed)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def split_threads(total: int | None, engines: int) -> int:
    """Threads per engine: ``total`` (default: the CPUs this process may use) shared evenly, at least 1 each."""
    if total is None:
        total = len(allowed_cpus())
    return max(1, total // engines)


def engine_cpu_sets(bind: str, engines: int, threads: int) -> list[str]:
    """``--cpu-omp-threads-bind`` of each engine: with ``auto``, engine ``i`` gets CPUs ``[i*threads, (i+1)*threads)``
    of those this process may use, so no two engines share a core (``nobind`` when they do not all fit); ``nobind``
    or an explicit list is passed to every engine unchanged."""
    if bind != "auto":
        return [bind] * engines
    allowed = allowed_cpus()
    if engines * threads > len(allowed) or not hasattr(os, "sched_setaffinity"):
        return ["nobind"] * engines
    return [",".join(str(c) for c in allowed[i * threads : (i + 1) * threads]) for i in range(engines)]


def _die_with_parent() -> None:
    """In the child before exec: on Linux, get SIGTERM when the stack process dies, even by SIGKILL (no orphans)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class EngineSupervisor:
    """Starts the engine children and restarts any that exit while the stack runs.

    ``argvs[i]`` is engine i's command line, ``env`` the children's environment (default ``engine_env()``). Each
    child's stdout and stderr go through one pipe to ``output`` (default: a ``TaggedOutput`` on this process's
    stderr), every line tagged ``engine-i``; a child's last lines are written before the supervisor logs its exit.

    An engine that exits is restarted after ``backoff_s``, doubling with each exit up to ``max_backoff_s``; an engine
    that had stayed up ``reset_after_s`` seconds before it exited starts over at ``backoff_s`` (regression: the
    back-off never reset, so after five crashes at any time every later one waited 30 s). ``poll_s``: how often exits
    are checked.

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
        output: TaggedOutput | None = None,
    ):
        self.argvs = argvs
        self.output = TaggedOutput() if output is None else output
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
        self._pumps: list[threading.Thread | None] = [None] * len(argvs)  # engine i's output reader
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
        proc = subprocess.Popen(
            self.argvs[i],
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one pipe: the child's stdout and stderr lines stay in the order written
        )
        self.procs[i] = proc
        self._started_at[i] = time.monotonic()
        assert proc.stdout is not None
        self._pumps[i] = self.output.start_pump(proc.stdout, engine_tag(i))
        logger.info("engine %d started (pid %d): %s", i, proc.pid, " ".join(self.argvs[i][2:]))

    def _drain(self, i: int, timeout_s: float = 2.0) -> None:
        """Wait (at most ``timeout_s``) until engine i's output is written: its reader ends at the pipe's end of
        file, which a descendant of the engine still holding the pipe may delay."""
        pump = self._pumps[i]
        if pump is not None:
            pump.join(timeout_s)

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
                    self._drain(i)  # its traceback before our line about its exit
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
                    logger.warning("engine %d %s; restarting in %g s", i, describe_exit(proc.returncode), delay)
                    restart_at[i] = now + delay
                    self.backoff[i] = min(delay * 2, self.max_backoff_s)
                elif now >= due and not self._stopping.is_set():
                    restart_at[i] = None
                    self._spawn(i)

    def _give_up(self, i: int, status: int | None) -> None:
        last = f"last exit status {status}" if status is None or status >= 0 else f"it last {describe_exit(status)}"
        tries = self.failed_starts[i]
        self.failure = f"engine {i} failed to start {tries} times in a row; {last}; see its output above"
        logger.error("%s", self.failure)
        if self.on_give_up is not None:
            self.on_give_up()

    def stop(self, grace_s: float | None = None) -> None:
        """Stop the engines: SIGTERM, then SIGKILL after ``grace_s`` seconds (default: the supervisor's). A
        KeyboardInterrupt meanwhile (Ctrl-C again) kills the engines still running at once, waits for them, and
        propagates."""
        grace_s = self.grace_s if grace_s is None else grace_s
        self._stopping.set()
        try:
            if self._thread.is_alive():
                self._thread.join(timeout=5)
            live = [p for p in self.procs if p is not None and p.poll() is None]
            for p in live:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for p in live:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("engine pid %d did not stop in %.0f s; killing it", p.pid, grace_s)
                    p.kill()
                    p.wait()
            for i in range(len(self.procs)):
                self._drain(i)
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
        for i in range(len(self.procs)):
            self._drain(i, timeout_s=0.5)


def run_local_stack(engine_args: EngineArgs, router_args: RouterArgs, engines: int, engine_base_port: int) -> int:
    """Run ``engines`` engine children on ``engine_base_port``, ``+1``, ... and the router (``router_args``, whose
    worker URLs are set here) in this process until Ctrl-C/SIGTERM, every output line tagged with its process.

    Ctrl-C/SIGTERM drains (module doc): the router admits nothing new and lets its requests in flight finish for up
    to ``router_args.shutdown_timeout`` seconds (also each engine's, through ``RADIXSERVE_SHUTDOWN_TIMEOUT``), then
    the engines get SIGTERM and that long plus ``ENGINE_STOP_GRACE_S`` before SIGKILL. A second Ctrl-C ends the
    router's requests at once and gives the engines ``ENGINE_STOP_GRACE_S``; one more while the engines stop kills
    them and raises KeyboardInterrupt. Returns the exit status: 0 after a stop by Ctrl-C/SIGTERM, 1 when an engine
    never came up (or the router could not start). Call it from the main thread (it sets the SIGTERM handler while
    it runs). Raises ValueError for a bad engine count, model path or port."""
    check_engine_ports(engines, engine_base_port)
    output = TaggedOutput(sys.stderr, tag_width=max(len(ROUTER_TAG), len(engine_tag(engines - 1))))
    with output.tag_this_process(ROUTER_TAG):
        status, failure = _serve_stack(engine_args, router_args, engines, engine_base_port, output)
    if failure is not None:
        print(f"radixserve up: {failure}", file=sys.stderr)  # untagged, the last line, after the engines' output
        return 1
    return status


def _serve_stack(
    engine_args: EngineArgs, router_args: RouterArgs, engines: int, engine_base_port: int, output: TaggedOutput
) -> tuple[int, str | None]:
    """``run_local_stack``'s body, within the tagged output: ``(exit status, why an engine was given up or None)``."""
    from radixserve.engine.model.locate import check_model_paths
    from radixserve.router.app import run_router

    threads = split_threads(engine_args.num_threads, engines)
    ports = [engine_base_port + i for i in range(engines)]
    check_model_paths(engine_args.model_path, engine_args.tokenizer_path)  # here, not in N engines' restart loops
    engine_args = size_engines(engine_args, engines)  # N engines must fit the memory together
    check_ports_free([(router_args.host, router_args.port)] + [("127.0.0.1", p) for p in ports])
    # An engine that cannot start ends the stack: SIGINT to this process stops the router as Ctrl-C does.
    timeout = router_args.shutdown_timeout
    supervisor = EngineSupervisor(
        [
            engine_argv(engine_args, port, threads, cpus)
            for port, cpus in zip(ports, engine_cpu_sets(engine_args.cpu_omp_threads_bind, engines, threads))
        ],
        grace_s=timeout + ENGINE_STOP_GRACE_S,  # an engine drains its own clients' requests too
        env=engine_env(api_key=engine_args.api_key, shutdown_timeout=timeout),
        on_give_up=lambda: os.kill(os.getpid(), signal.SIGINT),
        output=output,
    )
    router_args.worker_urls = [f"http://127.0.0.1:{port}" for port in ports]
    # SIGTERM stops the stack as Ctrl-C does. uvicorn hands the signal back once the router has stopped; with the
    # default action this process would die there, before stopping the engines, with status 143.
    previous_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    signals: list[int] = []  # one entry per Ctrl-C / SIGTERM the router took (its drain, then "at once")
    try:
        logger.info("starting %d engine(s) with %d thread(s) each on ports %s", engines, threads, ports)
        supervisor.start()
        status = run_router(router_args, on_signal=lambda: signals.append(1))
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM, or the supervisor giving up: a stop asked for
        status = 0
    finally:
        try:
            # The router has drained (or ended its requests at a second Ctrl-C): now the engines. Ctrl-C again here
            # kills them and propagates (status 130).
            supervisor.stop(grace_s=ENGINE_STOP_GRACE_S if len(signals) > 1 else None)
        finally:
            signal.signal(signal.SIGTERM, previous_sigterm or signal.SIG_DFL)
    return status, supervisor.failure
