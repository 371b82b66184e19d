"""Serving an ASGI app with uvicorn, as the engine and the router both do: one ``serve`` with a hook on SIGINT/SIGTERM,
probe requests kept out of the INFO access log, and the open-files limit raised for many concurrent streams."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

logger = logging.getLogger("radixserve.serving")

ACCESS_LOGGER = "uvicorn.access"


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
    **config: Any,
) -> int:
    """Serve ``app`` with uvicorn on ``host:port`` until SIGINT/SIGTERM; returns the exit status (0 once it served,
    1 if it never started, e.g. the port was taken). After a graceful shutdown uvicorn re-raises the signal it
    handled: SIGINT comes out of here as KeyboardInterrupt, SIGTERM ends the process with its default action.

    ``on_exit`` runs in the signal handler before uvicorn starts its graceful shutdown (each signal; must not block):
    the engine and the router end requests in flight there with a clean 503 / SSE error event instead of letting the
    graceful timeout cut them. ``probe_paths`` are kept out of the access log below DEBUG (``ProbeAccessFilter``).
    ``config``: further ``uvicorn.Config`` keywords (``backlog``, ``timeout_graceful_shutdown``, ...).
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

    server = Server(uconfig)
    try:
        server.run()
    finally:
        access.removeFilter(probe_filter)
    return 0 if server.started else 1
