"""The engine's graceful drain (docs/contracts.md, "Graceful drain"): ``radixserve engine`` processes over a tiny random
checkpoint (tests/tiny_model.py: the real Engine and scheduler, loads in about a second) take SIGTERM with a stream
and a non-stream request in flight. ``/health`` and new generation requests answer 503 with
``x-radixserve-draining: 1`` at once; the requests in flight finish (or, past ``--shutdown-timeout`` or at a second
signal, end with the usual 503 / SSE error event); the process exits 0. The HTTP gate alone is tested over the
FakeEngine, and the flag's default."""

from __future__ import annotations

import argparse
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
import pytest

from radixserve.contracts import constants
from radixserve.engine.config import EngineArgs, add_engine_args, engine_args_from_namespace, validate_engine_args

from conftest import ROOT, free_port, wait_healthy
from fake_engine import client, engine, tokenizer  # noqa: F401 - shared pytest fixtures
from tiny_model import write_tiny_model

LONG = 1800  # tokens: a few seconds on the tiny model on CPU (about 2.5 ms a token), well past the checks below
GENERATION = ("/v1/completions", "/v1/chat/completions", "/generate")
NEW_BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


class Engine:
    """A ``radixserve engine`` process on a free port, its log in ``log_path``."""

    def __init__(self, model: str, log_path: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "radixserve", "engine", "--model-path", model, "--device", "cpu"]
        cmd += ["--port", str(port), "--num-threads", "1", "--context-length", "2048", "--max-total-tokens", "8192"]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [*cmd, *flags],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        wait_healthy(self.url, self.proc, 120, log_path)

    def log(self) -> str:
        return self.log_path.read_text()

    def in_flight(self) -> int:
        load = httpx.get(self.url + "/load", timeout=5).json()
        return int(load["queued_requests"] + load["running_requests"])


@pytest.fixture
def run_engine(tiny_model: str, tmp_path: Path) -> Iterator[Any]:
    started: list[Engine] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> Engine:
        started.append(Engine(tiny_model, tmp_path / f"engine{len(started)}.log", *flags, env=env))
        return started[-1]

    yield start
    for e in started:
        if e.proc.poll() is None:
            e.proc.kill()
            e.proc.wait()


class Requests:
    """A long stream and a long non-stream completion, each in a thread."""

    def __init__(self, url: str, stream: bool = True, plain: bool = True) -> None:
        self.url = url
        self.lines: list[str] = []
        self.plain: httpx.Response | None = None
        self.first_chunk = threading.Event()
        self.threads = [threading.Thread(target=f) for f, on in ((self._stream, stream), (self._plain, plain)) if on]
        for t in self.threads:
            t.start()

    def _body(self, **extra: Any) -> dict[str, Any]:
        return {"prompt": "Count: 1, 2, 3,", "max_tokens": LONG, "ignore_eos": True, "temperature": 0, **extra}

    def _stream(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", json=self._body(stream=True), timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    self.lines.append(line)
                    self.first_chunk.set()

    def _plain(self) -> None:
        self.plain = httpx.post(self.url + "/v1/completions", json=self._body(), timeout=120)

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def join(self, timeout_s: float) -> float:
        """Wait for both to end (fails past ``timeout_s`` seconds); returns when the last one ended (monotonic)."""
        deadline = time.monotonic() + timeout_s
        while self.alive():
            assert time.monotonic() < deadline, "requests still in flight"
            time.sleep(0.02)
        return time.monotonic()

    def events(self) -> list[Any]:
        assert self.lines[-1] == "data: [DONE]", self.lines[-3:]
        return [json.loads(line.removeprefix("data: ")) for line in self.lines[:-1]]


def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def assert_draining_503(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers[constants.HEADER_DRAINING] == "1" and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == 503 and r.json()["error"]["type"] == "server_error"


def start_both(e: Engine) -> Requests:
    reqs = Requests(e.url)
    assert reqs.first_chunk.wait(60), "no streamed chunk"
    wait_for(lambda: e.in_flight() == 2, 30, "both requests admitted")
    return reqs


def test_sigterm_refuses_new_work_at_once_and_lets_requests_in_flight_finish(run_engine):
    e = run_engine(env={constants.SHUTDOWN_TIMEOUT_ENV: "60"})  # the env var is the flag's default
    reqs = start_both(e)
    e.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert_draining_503(httpx.get(e.url + constants.ENGINE_HEALTH_PATH, timeout=5))
    for path in GENERATION:
        assert_draining_503(httpx.post(e.url + path, json=NEW_BODIES[path], timeout=5))
    assert httpx.get(e.url + "/v1/models", timeout=5).status_code == 200  # the process still serves
    assert time.monotonic() - t0 < 2 and reqs.alive(), "the checks must run while both requests are in flight"

    last = reqs.join(60)
    events = reqs.events()
    assert all("error" not in ev for ev in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert reqs.plain is not None and reqs.plain.status_code == 200, reqs.plain
    body = reqs.plain.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == LONG
    assert e.proc.wait(15) == 0
    assert time.monotonic() - last < 10, "the engine waited on after its last request"
    log = e.log()
    assert "draining: 2 request(s) in flight may finish within 60 s" in log and "drained: every request" in log
    assert "Traceback" not in log


def test_past_the_shutdown_timeout_the_rest_end_with_the_usual_errors(run_engine):
    e = run_engine("--shutdown-timeout", "0.5")
    reqs = start_both(e)
    e.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    ended = reqs.join(30)
    assert 0.4 < ended - t0 < 10
    err = reqs.events()[-1]["error"]
    assert err["code"] == 503 and err["type"] == "server_error"
    assert reqs.plain is not None and reqs.plain.status_code == 503
    assert reqs.plain.json()["error"]["code"] == 503
    assert e.proc.wait(15) == 0
    log = e.log()
    assert "drain: 0.5 s passed; aborting the 2 request(s) still in flight" in log and "Traceback" not in log


def test_a_second_sigterm_aborts_at_once(run_engine):
    e = run_engine()  # 30 s
    reqs = start_both(e)
    e.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "draining:" in e.log(), 10, "the drain began")
    assert reqs.alive()
    e.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    ended = reqs.join(20)
    assert ended - t0 < 5
    assert reqs.events()[-1]["error"]["code"] == 503
    assert reqs.plain is not None and reqs.plain.status_code == 503
    assert e.proc.wait(15) == 0
    log = e.log()
    assert "drain: stopped at once; aborting the 2 request(s)" in log and "Traceback" not in log


# ---- in process: the HTTP gate over the FakeEngine, and the flag


def test_the_gate_refuses_generation_and_health_but_not_the_rest(client, engine):
    client.app.state.drain.draining = True
    assert_draining_503(client.get(constants.ENGINE_HEALTH_PATH))
    assert_draining_503(client.get(constants.ENGINE_HEALTH_GENERATE_PATH))
    for path in GENERATION:
        assert_draining_503(client.post(path, json=NEW_BODIES[path]))
    assert not engine.requests  # none reached the engine
    assert client.get("/v1/models").status_code == 200
    assert client.post("/abort_request", json={"rid": "x"}).status_code == 200  # aborting stays possible


def _parsed(argv: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_args_from_namespace(parser.parse_args(argv))


def test_shutdown_timeout_defaults_to_the_env_var_else_30(monkeypatch):
    monkeypatch.delenv(constants.SHUTDOWN_TIMEOUT_ENV, raising=False)
    assert _parsed([]).shutdown_timeout == constants.DEFAULT_SHUTDOWN_TIMEOUT_S == 30
    assert _parsed(["--shutdown-timeout", "0"]).shutdown_timeout == 0
    monkeypatch.setenv(constants.SHUTDOWN_TIMEOUT_ENV, "7.5")
    assert _parsed([]).shutdown_timeout == 7.5
    assert _parsed(["--shutdown-timeout", "2"]).shutdown_timeout == 2
    with pytest.raises(ValueError, match="--shutdown-timeout must be >= 0"):
        validate_engine_args(EngineArgs(shutdown_timeout=-1))
