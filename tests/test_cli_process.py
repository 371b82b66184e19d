"""The ``radixserve engine`` process itself: Ctrl-C with requests in flight and ``--shutdown-timeout 0`` (no graceful
drain: tests/test_engine_drain.py tests that) ends them cleanly and exits promptly."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import MODEL_DIR, ROOT, free_port, requires_model, wait_healthy

pytestmark = [requires_model, pytest.mark.slow]


def test_sigint_with_requests_in_flight_aborts_them_and_exits(tmp_path):
    # Regression: SIGINT waited out uvicorn's graceful timeout, then cut streams without [DONE] and answered the
    # non-streaming request with a plain-text 500 and CancelledError tracebacks.
    port = free_port()
    log = open(tmp_path / "engine.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixserve",
            "engine",
            "--model-path",
            MODEL_DIR,
            "--port",
            str(port),
            "--context-length",
            "2048",
            "--max-total-tokens",
            "8192",
            "--num-threads",
            "2",
            "--shutdown-timeout",
            "0",  # the drain ends at once: what is in flight is aborted as before the drain existed
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 240)
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200

        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
        results: dict[str, object] = {}
        started = threading.Event()

        def stream():
            lines = []
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()
            results["stream"] = lines

        def plain():
            results["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert started.wait(120), "no streamed chunk"
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(60)
        assert proc.wait(30) in (0, 130)  # 130: uvicorn re-raises SIGINT after a clean shutdown
        assert time.monotonic() - t0 < 10, "shutdown waited for in-flight requests instead of aborting them"

        lines = results["stream"]
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert "error" in last and last["error"]["code"] == 503
        plain = results["plain"]
        assert plain.status_code == 503 and plain.json()["error"]["code"] == 503
        log.seek(0)
        text = log.read()
        assert "Traceback" not in text
        # Probes and scrapes stay out of the INFO access log; real requests are in it.
        assert '"POST /v1/completions HTTP/1.1"' in text
        assert "GET /health" not in text and "GET /metrics" not in text
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
