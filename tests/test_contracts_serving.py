"""radixserve.contracts.serving and .sse: what the engine and the router share to serve HTTP."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from radixserve.contracts.protocol import error_body
from radixserve.contracts.serving import ACCESS_LOGGER, ProbeAccessFilter
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
    assert json.loads(event[6:]) == {
        "error": {"message": "boom", "type": "service_unavailable", "param": None, "code": 503}
    }
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
              probe_paths={"/health"})
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
