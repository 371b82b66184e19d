"""Serving an ASGI app with uvicorn, as the engine and the router both do: ``bind_listen_sockets`` first (a port in
use or a host that does not resolve is one line, before anything loads), one ``serve`` on those sockets with a hook on
SIGINT/SIGTERM, probe requests kept out of the INFO access log, and the open-files limit raised for many concurrent
streams."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Awaitable, Callable, Collection
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


class BindError(ValueError):
    """The server cannot listen where ``--host`` / ``--port`` say; ``str()`` is one line naming the flag. A
    ValueError, so the CLI prints it as it prints a bad flag value and exits 2."""


def _address_text(address: tuple[Any, ...]) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _bind_failure(host: str, port: int, address: tuple[Any, ...], e: OSError) -> str:
    where = _address_text(address)
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: {where} is already in use (another server listens there)"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: {where} is not an address of this machine ({e.strerror})"
    if e.errno == errno.EACCES:
        return f"--port {port}: no permission to listen on {where} (ports below 1024 need privileges)"
    return f"--host {host} --port {port}: cannot listen on {where} ({e.strerror or e})"


def bind_listen_sockets(host: str, port: int) -> list[socket.socket]:
    """One TCP socket bound (not yet listening) to each address ``host`` resolves to, as asyncio's ``create_server``
    (what uvicorn calls with a host and port) binds them: ``SO_REUSEADDR``, IPv6 sockets v6-only; ``port`` 0 takes a
    free port. Bound but not listening, a connection is still refused until ``serve`` listens on them (probes of an
    engine that is loading see what they saw before), yet a port some server listens on or a host that does not
    resolve fails here, in milliseconds (regression: ``engine --port P`` with P in use, or ``--host
    nosuchhost.invalid``, loaded the model for 6-19 s, then failed with uvicorn's exit status 3). A server that binds
    the same port meanwhile and listens first makes ``serve``'s listen fail with the same ``BindError``.

    Raises:
        BindError: ``host`` does not resolve or is not this machine's, or ``port`` is in use or not allowed.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise BindError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):  # unique, in the resolver's order
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                raise BindError(_bind_failure(host, port, address, e)) from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def listening_url(host: str, sockets: list[socket.socket]) -> str:
    """``http://HOST:PORT`` for the log: ``host`` as given (``localhost`` stays readable), the port bound."""
    port = sockets[0].getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(
    app: Any,
    host: str,
    port: int,
    log_level: str,
    *,
    sockets: list[socket.socket] | None = None,
    on_listening: Callable[[str], None] | None = None,
    on_exit: Callable[[], None] | None = None,
    drain: Callable[[], Awaitable[None]] | None = None,
    access_log: bool = True,
    probe_paths: Collection[str] = (),
    forced_shutdown_s: float = FORCED_SHUTDOWN_S,
    **config: Any,
) -> int:
    """Serve ``app`` with uvicorn on ``host:port`` until SIGINT/SIGTERM; returns the exit status (0 once it served,
    1 if it never started). After a graceful shutdown uvicorn re-raises the signal it handled: SIGINT comes out of
    here as KeyboardInterrupt, SIGTERM ends the process with its default action.

    ``sockets``: from ``bind_listen_sockets(host, port)``, bound by the caller before its slow start-up (the engine
    binds, then loads the model); without them ``serve`` binds first. Either way a port in use or a bad host raises
    ``BindError`` (one line) before the app starts. ``on_listening(url)`` runs once the sockets listen, after the
    app's lifespan started: the place for the "serving on URL" line (regression: logged before the bind failed).

    ``on_exit`` runs in the signal handler before uvicorn starts its graceful shutdown (each signal; must not block):
    the engine and the router end requests in flight there with a clean 503 / SSE error event instead of letting the
    graceful timeout cut them. ``probe_paths`` are kept out of the access log below DEBUG (``ProbeAccessFilter``).
    ``config``: further ``uvicorn.Config`` keywords (``backlog``, ``timeout_graceful_shutdown``, ...).

    ``drain``: a graceful drain (docs/contracts.md, "Graceful drain"). The first SIGINT/SIGTERM then does not stop
    uvicorn: ``on_exit`` runs, then ``drain()`` runs as a task on the server's loop while the server keeps listening
    (so readiness probes and new requests get the app's 503s rather than refused connections), and uvicorn's
    shutdown starts once it returns (or raises). A second signal during the drain cancels that task (``drain`` must
    then end what is left at once, e.g. in a ``finally``) and the shutdown follows; a signal after that forces the
    exit as below. ``drain`` bounds its own duration (the app's shutdown timeout). A signal before the server has
    started stops it at once, as without ``drain``.

    A second SIGINT (Ctrl-C twice) forces the exit: uvicorn stops waiting for connections and tasks and skips the
    app's lifespan shutdown, so ``asyncio.run`` would cancel the lifespan task and Starlette log that CancelledError
    as a failed shutdown (regression: a 12-line traceback, the router's cleanup cut). Here the lifespan shutdown
    still runs, for at most ``forced_shutdown_s`` seconds; if it takes longer it is cancelled without a traceback.
    """
    import uvicorn

    if sockets is None:
        sockets = bind_listen_sockets(host, port)
    url = listening_url(host, sockets)  # now: uvloop takes the sockets over (closes these objects) once it serves
    try:
        # Listen here, not in uvicorn: a second server bound to the port (SO_REUSEADDR; neither listening then)
        # may have started listening since, and uvloop's create_server swallows that EADDRINUSE and "serves" a
        # socket that takes no connection. Connections that come before uvicorn accepts wait in the backlog.
        for sock in sockets:
            sock.listen(config.get("backlog", 2048))
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise BindError(_bind_failure(host, port, (host, port), e)) from None
    access = logging.getLogger(ACCESS_LOGGER)
    probe_filter = ProbeAccessFilter(probe_paths)
    if probe_paths:
        access.addFilter(probe_filter)
    uconfig = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=access_log, **config)

    class Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        drain_task: asyncio.Task[None] | None = None
        draining = False  # the first signal started the drain (and not the shutdown)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if on_exit is not None:
                on_exit()
            if drain is None or self.loop is None or self.should_exit:
                super().handle_exit(sig, frame)
                return
            self._captured_signals.append(sig)  # re-raised once the server has stopped, as uvicorn does
            if self.draining:  # a second signal: stop draining, shut down now
                self.loop.call_soon_threadsafe(self._cancel_drain)
            else:
                self.draining = True
                self.loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            assert drain is not None
            self.drain_task = asyncio.ensure_future(drain())
            self.drain_task.add_done_callback(self._drained)

        def _cancel_drain(self) -> None:
            if self.drain_task is not None and not self.drain_task.done():
                self.drain_task.cancel()

        def _drained(self, task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                logger.error("drain failed; shutting down", exc_info=task.exception())
            self.should_exit = True

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            self.loop = asyncio.get_running_loop()
            if self.started and on_listening is not None:
                on_listening(url)

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
        server.run(sockets=sockets)
    finally:
        access.removeFilter(probe_filter)
        error_log.removeFilter(forced_filter)
        for sock in sockets:
            sock.close()
    return 0 if server.started else 1
