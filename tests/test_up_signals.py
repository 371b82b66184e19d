"""``radixserve up`` as a process: Ctrl-C twice stops the stack at once and cleanly (exit status 0), and the engines'
output is not garbled by progress bars and is tagged with its process."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, requires_model

pytestmark = [requires_model, pytest.mark.slow]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_double_ctrl_c_stops_the_stack_without_a_traceback(tmp_path):
    # Regression: the second SIGINT made uvicorn skip the router's lifespan shutdown and Starlette log a 12-line
    # CancelledError traceback. Also: the engines' "Loading weights" bars interleaved on the terminal.
    port, base = free_port(), free_port()
    log_path = tmp_path / "up.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "radixserve",
                "up",
                "--engines",
                "1",
                "--port",
                str(port),
                "--engine-base-port",
                str(base),
                "--num-threads",
                "2",
                "--context-length",
                "2048",
                "--max-total-tokens",
                "8192",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # a process group of its own, as a terminal's Ctrl-C reaches it
        )
    engine_pids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while "radixserve.router: ready: " not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no ready line"
            time.sleep(0.2)
        engine_pids = [int(p) for p in re.findall(r"engine \d+ started \(pid (\d+)\)", log_path.read_text())]
        assert len(engine_pids) == 1
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        # Both reach the router's shutdown (which still completes): a stop asked for, everything stopped: status 0.
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in engine_pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"engine pid {pid} was left running")
    text = log_path.read_text()
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    assert text.count("Application shutdown complete.") == 2, text[-3000:]  # the router's and the engine's
    assert "Loading weights" not in text and "it/s]" not in text and "tensor/s]" not in text
    # Every line says which process wrote it, the real engine's (uvicorn's own lines included) and the router's.
    lines = text.splitlines()
    assert all(line.startswith(("router   | ", "engine-0 | ")) for line in lines), text[-3000:]
    assert any(line.startswith("engine-0 | ") and "Application shutdown complete." in line for line in lines)
    assert any(line.startswith("router   | ") and "radixserve.router: ready: " in line for line in lines)
