"""``radixserve up`` as a process, with stand-in engines (no model is loaded): Ctrl-C or SIGTERM ends it with exit
status 0 and every line it wrote tagged with its process; an engine that crashes at start-up ends it with status 1,
its traceback tagged.

The stack runs as ``python -m radixserve up`` does (``cli.main``, the real router under uvicorn, the real supervisor),
except that ``local_stack.engine_argv`` puts a stand-in script before the real engine flags.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from radixserve.contracts import constants

from conftest import ROOT, free_port

DRIVER = (
    "import sys\n"
    "from radixserve.launch import cli, local_stack\n"
    "stand_in, real = sys.argv[1], local_stack.engine_argv\n"
    "local_stack.engine_argv = lambda args, port, threads, cpus: "
    "[sys.executable, stand_in, *real(args, port, threads, cpus)[1:]]\n"
    "sys.exit(cli.main(sys.argv[2:]))\n"
)
SERVES = (
    "import signal, sys, time\n"
    "def stop(signum, frame):\n"
    "    print('stand-in engine: stopping on SIGTERM', flush=True)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "print('stand-in engine: up', flush=True)\n"
    "print('stand-in engine: a line on stderr', file=sys.stderr, flush=True)\n"
    "while True:\n"
    "    time.sleep(1)\n"
)
CRASHES = "raise RuntimeError('stand-in engine: cannot load the model')\n"
# A fake engine (tests/fake_engine_server.py: the real engine HTTP layer, scripted tokens) on the port `up` gives it;
# it also prints the shutdown timeout it was given in its environment.
FAKE_ENGINE = (
    "import os, sys\n"
    f"print('stand-in engine: shutdown timeout', os.environ.get('{constants.SHUTDOWN_TIMEOUT_ENV}'), flush=True)\n"
    "port = sys.argv[sys.argv.index('--port') + 1]\n"
    f"script = {os.path.join(ROOT, 'tests', 'fake_engine_server.py')!r}\n"
    "os.execv(sys.executable, [sys.executable, script, '--port', port, '--delay-s', '0.02'])\n"
)
TAGS = ("router   | ", "engine-0 | ", "engine-1 | ")


def _start_up(
    tmp_path: Path, engine_script: str, engines: int, *flags: str
) -> tuple[subprocess.Popen[bytes], Path, int]:
    model = tmp_path / "model"  # passes the start-up path check; the stand-in engines never read it
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    script = tmp_path / "engine.py"
    script.write_text(engine_script)
    log_path = tmp_path / "up.log"
    port = free_port()
    argv = ["up", "--engines", str(engines), "--port", str(port), "--engine-base-port", str(free_port()), *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(script), *argv, "--model-path", str(model)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # a process group of its own, as a terminal's Ctrl-C reaches it
        )
    return proc, log_path, port


def _wait_for(proc: subprocess.Popen[bytes], log_path: Path, needles: list[str], timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while not all(n in (text := log_path.read_text()) for n in needles):
        assert proc.poll() is None, text[-3000:]
        assert time.monotonic() < deadline, f"never saw {needles}: {text[-3000:]}"
        time.sleep(0.1)
    return text


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stop_asked_for_exits_0_with_every_line_tagged(tmp_path: Path, how: str) -> None:
    # Regression (issue 11): Ctrl-C on `make run` ended with make's "Error 130" (make reports the recipe's status);
    # SIGTERM ended the process by the signal before it stopped its engines. And no line said which process wrote it.
    proc, log_path, _ = _start_up(tmp_path, SERVES, engines=2)
    engine_pids: list[int] = []
    try:
        text = _wait_for(
            proc,
            log_path,
            ["Application startup complete.", "engine-0 | stand-in engine: up", "engine-1 | stand-in engine: up"],
        )
        engine_pids = [int(p) for p in re.findall(r"engine \d started \(pid (\d+)\)", text)]
        assert len(engine_pids) == 2
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal does (the engines have sessions of their own)
        else:
            proc.send_signal(signal.SIGTERM)  # what `kill`, make on SIGTERM, or a container runtime does
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = log_path.read_text().splitlines()
    assert lines and all(line.startswith(TAGS) for line in lines), [ln for ln in lines if not ln.startswith(TAGS)]
    assert any(ln.startswith("router   | ") and "Application startup complete." in ln for ln in lines)  # uvicorn's
    assert any(ln.startswith("router   | ") and "radixserve.up: engine 1 started" in ln for ln in lines)
    assert "engine-1 | stand-in engine: a line on stderr" in lines
    for i in (0, 1):  # the engines were stopped by the stack, and their last words are there too
        assert f"engine-{i} | stand-in engine: stopping on SIGTERM" in lines
    assert not [pid for pid in engine_pids if _alive(pid)]


def test_an_engine_that_crashes_at_start_ends_the_stack_with_1_and_its_tagged_traceback(tmp_path: Path) -> None:
    # A real failure stays non-zero: an engine that exits at once, 3 times in a row, ends `up` with status 1.
    proc, log_path, _ = _start_up(tmp_path, CRASHES, engines=1)
    try:
        assert proc.wait(90) == 1, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = log_path.read_text().splitlines()
    failure = "engine 0 failed to start 3 times in a row; last exit status 1; see its output above"
    assert lines[-1] == f"radixserve up: {failure}"  # the one untagged line: the stack's verdict, written last
    assert all(line.startswith(TAGS) for line in lines[:-1])
    assert lines.count("engine-0 | Traceback (most recent call last):") == 3
    crash = "engine-0 | RuntimeError: stand-in engine: cannot load the model"
    assert lines.count(crash) == 3
    given_up = next(i for i, ln in enumerate(lines) if ln.startswith("router   | ") and ln.endswith(failure))
    assert max(i for i, ln in enumerate(lines) if ln == crash) < given_up  # the traceback first, then the verdict


def test_ctrl_c_drains_the_stack_and_a_second_ctrl_c_stops_it_at_once(tmp_path: Path) -> None:
    # Issue 16: Ctrl-C ended every stream in flight. Now the router stops admitting, streams go on; Ctrl-C again ends
    # what is left with the error event at once; then the engines stop, and `up` exits 0.
    proc, log_path, port = _start_up(tmp_path, FAKE_ENGINE, 1, "--shutdown-timeout", "60")
    url = f"http://127.0.0.1:{port}"
    streams: dict[int, list[str]] = {80: [], 400: []}  # max_tokens -> its SSE data lines (20 ms a token)
    started = {n: threading.Event() for n in streams}

    def stream(n: int) -> None:
        body = {"prompt": "x", "max_tokens": n, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    streams[n].append(line)
                    started[n].set()

    try:
        _wait_for(proc, log_path, ["radixserve.router: ready: "], timeout_s=90)
        threads = [threading.Thread(target=stream, args=(n,), daemon=True) for n in streams]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started.values())
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        deadline = time.monotonic() + 10
        while httpx.get(url + "/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "readiness did not fail at Ctrl-C"
        refused = httpx.post(url + "/v1/completions", json={"prompt": "y", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.headers[constants.HEADER_DRAINING] == "1"
        threads[0].join(30)  # the short stream finishes while the stack drains
        assert threads[1].is_alive() and proc.poll() is None
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C again: at once
        threads[1].join(10)
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 15  # at once (the engine's own 2 s stop included), not the 60 s bound
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    short = [json.loads(line.removeprefix("data: ")) for line in streams[80][:-1]]
    assert streams[80][-1] == "data: [DONE]" and not any("error" in e for e in short)
    assert short[-1]["choices"][0]["finish_reason"] == "length" and len(short) >= 80
    long = [json.loads(line.removeprefix("data: ")) for line in streams[400][:-1]]
    assert streams[400][-1] == "data: [DONE]" and long[-1]["error"]["code"] == 503
    text = log_path.read_text()
    assert "engine-0 | stand-in engine: shutdown timeout 60" in text  # the engine's drain gets the same bound
    assert "draining: 2 request(s) in flight" in text and "drain: stopped at once" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
