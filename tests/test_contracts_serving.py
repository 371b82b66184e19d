"""radixserve.contracts.serving and .sse: what the engine and the router share to serve HTTP."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from radixserve.contracts.protocol import error_body
from radixserve.contracts.serving import ACCESS_LOGGER, BindError, ProbeAccessFilter, bind_listen_sockets, serve
from radixserve.contracts.sse import SSE_DONE, sse, sse_error

from conftest import free_port


def access_record(path: str) -> logging.LogRecord:
    # uvicorn's access-log record: '%s - "%s %s HTTP/%s" %d'
    return logging.LogRecord(
        ACCESS_LOGGER,
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("1.2.3.4:5", "GET", path, "1.1", 200),
        None,
    )


def test_probe_requests_leave_the_info_access_log_and_others_stay() -> None:
    f = ProbeAccessFilter({"/health", "/metrics"})
    logger = logging.getLogger(ACCESS_LOGGER)
    old = logger.level
    try:
        logger.setLevel(logging.INFO)
        assert not f.filter(access_record("/health"))
        assert not f.filter(access_record("/metrics?x=1"))  # the query is not part of the path
        assert f.filter(access_record("/v1/chat/completions"))
        assert f.filter(access_record("/healthz"))
        logger.setLevel(logging.DEBUG)
        assert f.filter(access_record("/health"))  # at DEBUG every request is logged
    finally:
        logger.setLevel(old)


def test_sse_framing() -> None:
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    event = sse_error("boom", 503)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:]) == error_body("boom", 503)  # the same object as an HTTP error answer
    assert json.loads(event[6:]) == {"error": {"message": "boom", "type": "server_error", "param": None, "code": 503}}
    assert json.loads(sse_error("bad", 400, "messages[0].content")[6:])["error"]["param"] == "messages[0].content"
    assert SSE_DONE == b"data: [DONE]\n\n"


def start_script(script: str, *args: str) -> subprocess.Popen[str]:
    """``python -c script args...`` with its stdout and stderr piped (text, unbuffered)."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        # SIGINT as a terminal gives it: a run started in the background (`nohup ... &`) hands its children SIGINT
        # ignored, Python then installs no KeyboardInterrupt handler, and uvicorn's re-raised SIGINT exits 0, not 130.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for_server(proc: subprocess.Popen[str], port: int, timeout_s: float = 30.0) -> None:
    """Until the server ``proc`` answers on 127.0.0.1:``port``; fails if it exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
            time.sleep(0.1)


SERVER = textwrap.dedent(
    """
    import logging, sys
    from radixserve.contracts.serving import serve

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        serve(app, "127.0.0.1", int(sys.argv[1]), "info", on_exit=lambda: print("ON_EXIT", flush=True),
              probe_paths={"/health"}, on_listening=lambda url: print("LISTENING", url, flush=True))
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, once shut down
        sys.exit(130)
    """
)


def test_serve_calls_on_exit_on_sigint_and_keeps_probes_out_of_the_log() -> None:
    port = free_port()
    proc = start_script(SERVER, str(port))
    try:
        wait_for_server(proc, port)
        assert httpx.get(f"http://127.0.0.1:{port}/health").text == "ok"
        assert httpx.get(f"http://127.0.0.1:{port}/work").text == "ok"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "ON_EXIT" in out
    assert f"LISTENING http://127.0.0.1:{port}\n" in out  # the "serving on URL" hook, once listening
    assert '"GET /work HTTP/1.1" 200' in out  # uvicorn's access log goes to stdout
    assert "/health" not in out + err


FORCED_SERVER = textwrap.dedent(
    """
    import contextlib, logging, os, signal, sys
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from radixserve.contracts.serving import serve

    hang = sys.argv[2] == "hang"

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            print("CLEANUP STARTED", flush=True)
            if hang:
                import asyncio
                await asyncio.sleep(60)
            print("CLEANUP DONE", flush=True)

    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/health", ok)], lifespan=lifespan)
    signals = []

    def on_exit():
        signals.append(1)
        if len(signals) == 1:  # Ctrl-C twice: the second SIGINT before uvicorn begins its shutdown
            os.kill(os.getpid(), signal.SIGINT)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        serve(app, "127.0.0.1", int(sys.argv[1]), "info", on_exit=on_exit, forced_shutdown_s=0.5)
    except KeyboardInterrupt:
        sys.exit(130)
    """
)


@pytest.mark.parametrize("mode", ["quick", "hang"])
def test_second_sigint_exits_at_once_without_a_traceback_and_runs_the_lifespan_shutdown(mode: str) -> None:
    # Regression: a second Ctrl-C made uvicorn skip the lifespan shutdown; asyncio.run then cancelled the lifespan
    # task and Starlette's "lifespan.shutdown.failed" CancelledError traceback was logged (the app's cleanup cut).
    port = free_port()
    proc = start_script(FORCED_SERVER, str(port), mode)
    try:
        wait_for_server(proc, port)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert "CLEANUP STARTED" in out  # the app's shutdown ran despite the forced exit
    if mode == "quick":
        assert "CLEANUP DONE" in out and "cut short" not in err
        assert elapsed < 5
    else:  # a shutdown that hangs is cut after forced_shutdown_s, quietly
        assert "CLEANUP DONE" not in out and "application shutdown cut short after 0.5 s" in err
        assert elapsed < 10


# ------------------------------------------------------------------------------------- binding before serving
# Regression (newcomer trial, item 10): `engine --port P` with P in use, or `--host nosuchhost.invalid`, loaded the
# model for 6-19 s, then failed with uvicorn's exit status 3 after logging "serving ... on http://nosuchhost.invalid";
# the router logged "router serving on http://127.0.0.1:2024" before "[Errno 98] address already in use".


def test_a_port_in_use_and_a_host_that_does_not_resolve_are_one_line_bind_errors() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(BindError, match=rf"^--port {port}: 127.0.0.1:{port} is already in use"):
            bind_listen_sockets("127.0.0.1", port)
    with pytest.raises(BindError, match=r"^--host nosuchhost.invalid: cannot resolve it \("):
        bind_listen_sockets("nosuchhost.invalid", 30000)
    with pytest.raises(BindError, match=r"^--host 192.0.2.1: 192.0.2.1:30000 is not an address of this machine"):
        bind_listen_sockets("192.0.2.1", 30000)  # TEST-NET-1: no machine's own address
    assert issubclass(BindError, ValueError)  # the CLI's usage-error path: one line, exit status 2


def test_bound_sockets_refuse_connections_until_they_listen() -> None:
    # The engine binds before it loads the model: a probe meanwhile must still see a refused connection, as before.
    sockets = bind_listen_sockets("127.0.0.1", 0)
    try:
        port = sockets[0].getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        for sock in sockets:
            sock.close()


def test_serve_on_a_port_in_use_raises_before_the_app_starts_or_the_serving_line() -> None:
    started: list[str] = []

    async def app(scope, receive, send):  # never reached
        started.append(scope["type"])

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(BindError, match=f"--port {port}"):
            serve(app, "127.0.0.1", port, "info", on_listening=started.append)
    assert started == []  # no lifespan ran and no "serving on" line was logged


def test_a_port_taken_between_bind_and_listen_is_the_same_one_line_error() -> None:
    # Two servers started at once on one port both bind (SO_REUSEADDR, neither listening yet); the one that listens
    # second must fail with the bind error before its app starts (uvloop's create_server swallows that EADDRINUSE:
    # the server then hung, "serving" a socket that took no connection).
    seen: list[str] = []

    async def app(scope, receive, send):
        seen.append(scope["type"])
        if scope["type"] == "lifespan":
            message = await receive()
            while message["type"] != "lifespan.shutdown":
                await send({"type": message["type"] + ".complete"})
                message = await receive()
            await send({"type": "lifespan.shutdown.complete"})

    sockets = bind_listen_sockets("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    with socket.socket() as first:
        first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        first.bind(("127.0.0.1", port))
        first.listen()
        with pytest.raises(BindError, match=f"^--port {port}: .* is already in use"):
            serve(app, "127.0.0.1", port, "info", sockets=sockets, on_listening=seen.append)
    assert seen == []  # the app never started; no "serving on" line
    assert all(sock.fileno() == -1 for sock in sockets)  # closed
