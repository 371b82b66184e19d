"""The ``radixserve router`` process itself, on SIGTERM (docs/contracts.md, "Graceful drain"): readiness fails and new
requests get an OpenAI-format 503 at once, streams in flight finish; those still running after ``--shutdown-timeout``
(or at a second signal) end with an SSE error event and ``[DONE]``; no tracebacks, and the process exits promptly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from radixserve.contracts import constants
from radixserve.engine.server.http import create_app as engine_app

from conftest import ROOT, free_port
from fake_engine import FakeEngine, ServerThread, load_tokenizer

LONG = "one two three four five six seven eight nine ten " * 40  # 400 tokens: a stream of ~400 events


@contextlib.contextmanager
def router_process(upstream: str, log_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A ``radixserve router`` in front of ``upstream``, ready (``/ready`` 200); killed at exit if still running."""
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve", "router", "--worker-urls", upstream, "--port", str(port)]
            + ["--health-interval-s", "0.5", *flags],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the router never became ready"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class Stream:
    """One streamed completion through the router in a thread: ``lines`` (the SSE ``data:`` lines as they come)."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.lines: list[str] = []
        self.started = threading.Event()
        body = {"prompt": "x", "max_tokens": max_tokens, "stream": True}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()
        assert self.started.wait(30), "the stream never started"

    def _run(self, url: str, body: dict[str, Any]) -> None:
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json=body) as r:
            for line in r.iter_lines():
                if line:
                    self.lines.append(line)
                    self.started.set()

    def events(self) -> list[dict[str, Any]]:
        assert self.lines[-1] == "data: [DONE]", self.lines[-3:]
        return [json.loads(line.removeprefix("data: ")) for line in self.lines[:-1]]


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_sigterm_drains_streams_in_flight_refuses_new_requests_and_ends_the_rest_at_the_timeout(
    tmp_path: Path,
) -> None:
    engine = FakeEngine(load_tokenizer(), delay_s=0.02)
    engine.set_outputs([LONG])
    with ServerThread(engine_app(engine, manage_engine=False)) as upstream:
        with router_process(upstream, tmp_path / "router.log", "--shutdown-timeout", "3") as (proc, url):
            short = Stream(url, max_tokens=80)  # ~1.6 s of events: finishes within the timeout
            long = Stream(url, max_tokens=400)  # ~8 s: still running at the timeout
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            # Readiness fails at once, and a new request is refused, while the streams go on.
            wait_for(lambda: httpx.get(url + "/ready", timeout=2).status_code == 503, 5, "/ready 503")
            health = httpx.get(url + "/health", timeout=2)
            assert health.status_code == 503 and health.json()["status"] == "draining"
            assert health.headers[constants.HEADER_DRAINING] == "1"
            refused = httpx.post(url + "/v1/completions", json={"prompt": "y", "max_tokens": 2}, timeout=5)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "server_error"
            assert "shutting down" in refused.json()["error"]["message"]
            assert proc.poll() is None and short.thread.is_alive() and long.thread.is_alive()
            short.thread.join(30)
            long.thread.join(30)
            assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
            assert 2.5 < time.monotonic() - t0 < 10, "the router did not stop at its shutdown timeout"
        wait_for(lambda: len(engine.aborted) == 1, 5, "the long stream's request aborted on the engine")
    events = short.events()  # finished: every token, no error
    assert not any("error" in e for e in events), events[-2:]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and len(events) >= 80
    events = long.events()  # cut at the timeout: the error event it got at SIGTERM before the drain, then [DONE]
    assert events[-1]["error"]["code"] == 503 and "shutting down" in events[-1]["error"]["message"]
    assert not any("error" in e for e in events[:-1]) and len(events) > 80
    log = (tmp_path / "router.log").read_text()
    assert "Traceback" not in log, log[-2000:]
    assert "draining: 2 request(s) in flight" in log and "drain: 3 s passed; ending the 1 request(s)" in log, log
