"""The ``radixserve router`` process itself: SIGTERM with streams in flight ends them with an SSE error event and
``[DONE]`` (and non-streaming ones with an OpenAI 503), logs no tracebacks, and exits promptly."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from radixserve.engine.server.http import create_app as engine_app

from conftest import ROOT, free_port
from fake_engine import FakeEngine, ServerThread, load_tokenizer


def test_sigterm_ends_streams_with_an_error_event(tmp_path):
    # Regression: streams were cut without an event after the 5 s graceful timeout, one traceback logged per stream.
    slow = FakeEngine(load_tokenizer(), delay_s=0.2)
    with ServerThread(engine_app(slow, manage_engine=False)) as upstream:
        port = free_port()
        log = open(tmp_path / "router.log", "w+")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "radixserve",
                "router",
                "--worker-urls",
                upstream,
                "--port",
                str(port),
                "--health-interval-s",
                "0.5",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            results: dict[str, object] = {}
            started = threading.Event()

            def stream() -> None:
                lines = []
                with httpx.stream(
                    "POST", url + "/v1/completions", timeout=60, json={"prompt": "x", "max_tokens": 500, "stream": True}
                ) as r:
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
                            started.set()
                results["stream"] = lines

            t = threading.Thread(target=stream)
            t.start()
            assert started.wait(30)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            t.join(30)
            assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after a clean shutdown
            assert time.monotonic() - t0 < 4, "the router waited out its graceful timeout"
            lines = results["stream"]
            assert lines[-1] == "data: [DONE]"
            event = json.loads(lines[-2].removeprefix("data: "))
            assert event["error"]["code"] == 503 and "shutting down" in event["error"]["message"]
            log.seek(0)
            assert "Traceback" not in log.read()
            assert slow.aborted  # the engine's request was aborted, not left running
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
