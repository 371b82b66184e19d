"""Serving an ASGI app with uvicorn, as the engine and the router both do: one ``serve`` with a hook on SIGINT/SIGTERM,
probe requests kept out of the INFO access log, and the open-files limit raised for many concurrent streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

logger = logging.getLogger("radixserve.serving")

ACCESS_LOGGER = "uvicorn.access"
ERROR_LOGGER = "uvicorn.error"

# Seconds the app's lifespan shutdown may take after a forced exit (a second Ctrl-C) before the process goes anyway.
FORCED_SHUTDOWN_S = 3.0


class ProbeAccessFilter(logging.Filter):
    """Drops uvicorn access-log records of probe and scrape requests (``probe_paths``: Kubernetes and the router probe
    every few seconds, Prometheus scrapes) unless the access logger is at DEBUG. uvicorn's record args are
    ``(client, method, path_with_query, http_version, status)``."""

    def __init__(self, probe_paths: Collection[str]):
        super().__init__()
        self.probe_paths = frozenset(probe_paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3 or not isinstance(args[2], str):
            return True
        path = args[2].partition("?")[0]
        return path not in self.probe_paths or logging.getLogger(ACCESS_LOGGER).isEnabledFor(logging.DEBUG)


class ForcedExitFilter(logging.Filter):
    """Drops the traceback of a lifespan cancelled by a forced exit: once ``forced()`` is true, an ERROR record whose
    message is a traceback ending in ``CancelledError`` (Starlette's ``lifespan.shutdown.failed`` message, which
    uvicorn logs) says only that the second Ctrl-C cut the shutdown short, which ``serve`` logs in one line."""

    def __init__(self, forced: Callable[[], bool]):
        super().__init__()
        self.forced = forced

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not isinstance(record.msg, str) or not self.forced():
            return True
        text = record.msg.rstrip()
        last = text.rpartition("\n")[2]
        return not (text.startswith("Traceback") and last.split(":")[0].endswith("CancelledError"))


def raise_open_files_limit() -> None:
    """Raise the soft open-files limit to the hard one: a router holds two sockets per stream (client + engine), and
    the usual soft limit of 1024 would refuse connections near 500 concurrent streams. Keeps the limit where the OS
    does not allow it (or is not POSIX)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft == resource.RLIM_INFINITY or soft >= target:
            return
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - not POSIX, or not allowed
        pass


def serve(
    app: Any,
    host: str,
    port: int,
    log_level: str,
    *,
    on_exit: Callable[[], None] | None = None,
    access_log: bool = True,
    probe_paths: Collection[str] = (),
    forced_shutdown_s: float = FORCED_SHUTDOWN_S,
    **config: Any,
) -> int:
    """Serve ``app`` with uvicorn on ``host:port`` until SIGINT/SIGTERM; returns the exit status (0 once it served,
    1 if it never started, e.g. the port was taken). After a graceful shutdown uvicorn re-raises the signal it
    handled: SIGINT comes out of here as KeyboardInterrupt, SIGTERM ends the process with its default action.

    ``on_exit`` runs in the signal handler before uvicorn starts its graceful shutdown (each signal; must not block):
    the engine and the router end requests in flight there with a clean 503 / SSE error event instead of letting the
    graceful timeout cut them. ``probe_paths`` are kept out of the access log below DEBUG (``ProbeAccessFilter``).
    ``config``: further ``uvicorn.Config`` keywords (``backlog``, ``timeout_graceful_shutdown``, ...).

    A second SIGINT (Ctrl-C twice) forces the exit: uvicorn stops waiting for connections and tasks and skips the
    app's lifespan shutdown, so ``asyncio.run`` would cancel the lifespan task and Starlette log that CancelledError
    as a failed shutdown (regression: a 12-line traceback, the router's cleanup cut). Here the lifespan shutdown
    still runs, for at most ``forced_shutdown_s`` seconds; if it takes longer it is cancelled without a traceback.
    """
    import uvicorn

    access = logging.getLogger(ACCESS_LOGGER)
    probe_filter = ProbeAccessFilter(probe_paths)
    if probe_paths:
        access.addFilter(probe_filter)
    uconfig = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=access_log, **config)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if on_exit is not None:
                on_exit()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets: Any = None) -> None:
            await super().shutdown(sockets)
            done = getattr(self.lifespan, "shutdown_event", None)  # LifespanOn's; None with lifespan "off"
            if not self.force_exit or done is None or done.is_set():
                return
            try:
                await asyncio.wait_for(self.lifespan.shutdown(), forced_shutdown_s)
            except TimeoutError:
                logger.warning("forced exit: application shutdown cut short after %g s", forced_shutdown_s)

    server = Server(uconfig)
    forced_filter = ForcedExitFilter(lambda: server.force_exit)
    error_log = logging.getLogger(ERROR_LOGGER)
    error_log.addFilter(forced_filter)
    try:
        server.run()
    finally:
        access.removeFilter(probe_filter)
        error_log.removeFilter(forced_filter)
    return 0 if server.started else 1
