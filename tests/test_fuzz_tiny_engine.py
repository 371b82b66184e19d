"""Fuzzing a real engine process (the tiny random checkpoint of tests/tiny_model.py: the real scheduler, tokenizer,
chat template and grammar paths), and the router in front of it, with the hostile bodies of tests/fuzz_inputs.py.

A smaller budget than tests/test_fuzz_http.py (a third of ``RADIXSERVE_FUZZ_EXAMPLES``): here requests generate. The
engine's context is 512 tokens, so no request generates for long. After each example the process must still run;
after each test it answers a normal request of every endpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import given, settings

from radixserve.router.app import create_app as router_app
from radixserve.router.config import RouterArgs

from conftest import ROOT, free_port, wait_healthy
from fake_engine import wait_until
from fuzz_inputs import (
    ENDPOINTS,
    EXAMPLES,
    FUZZ_SETTINGS,
    MODEL,
    AsgiClient,
    HttpClient,
    check,
    encode,
    fuzz_schema,
    mutated_body,
    raw_request,
    still_serves,
)
from tiny_model import write_tiny_model

TINY_SETTINGS = settings(FUZZ_SETTINGS, max_examples=max(EXAMPLES // 3, 5))


class EngineProcess:
    """``radixserve engine`` on the tiny model on a free port (context 512 tokens), its log in ``log_path``."""

    def __init__(self, model: str, log_path: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "radixserve", "engine", "--model-path", model, "--device", "cpu", "--port"]
        cmd += [str(port), "--num-threads", "1", "--context-length", "512", "--max-total-tokens", "8192"]
        cmd += ["--served-model-name", MODEL]
        with open(log_path, "w") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        wait_healthy(self.url, self.proc, 120, log_path)

    def alive(self) -> None:
        assert self.proc.poll() is None, "the engine died:\n" + self.log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    tmp = tmp_path_factory.mktemp("fuzz-tiny")
    proc = EngineProcess(write_tiny_model(tmp / "model"), tmp / "engine.log")
    yield proc
    proc.proc.kill()
    proc.proc.wait()


@pytest.fixture(scope="module")
def engine_client(engine: EngineProcess) -> HttpClient:
    return HttpClient(engine.url)


@pytest.fixture(scope="module")
def router_client(engine: EngineProcess) -> Iterator[AsgiClient]:
    """The router in-process (its lifespan running) in front of the engine process."""
    portal: BlockingPortal
    with start_blocking_portal() as portal:
        app = router_app(RouterArgs(worker_urls=[engine.url], health_interval_s=0.5))
        with portal.wrap_async_context_manager(app.router.lifespan_context(app)):
            client = AsgiClient(portal, app)
            assert wait_until(lambda: client.request("GET", "/ready").status_code == 200, 30)
            yield client


@pytest.fixture(params=["engine", "router"])
def server(request: pytest.FixtureRequest) -> AsgiClient:
    return request.getfixturevalue(f"{request.param}_client")  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzz_tiny_engine_odd_fields(server: AsgiClient, engine: EngineProcess, path: str) -> None:
    @TINY_SETTINGS
    @given(body=mutated_body(path))
    def run(body: dict[str, Any]) -> None:
        check(server.post_json(path, body), f"POST {path} {encode(body)[:2000]!r}")
        engine.alive()

    run()
    still_serves(server)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_fuzz_tiny_engine_raw_bodies(engine_client: HttpClient, engine: EngineProcess, path: str) -> None:
    @TINY_SETTINGS
    @given(req=raw_request(path))
    def run(req: tuple[bytes, dict[str, str]]) -> None:
        raw, headers = req
        check(engine_client.request("POST", path, raw, headers), f"POST {path} {headers} {raw[:2000]!r}")
        engine.alive()

    run()
    still_serves(engine_client)


def test_schemathesis_tiny_engine(engine_client: HttpClient, engine: EngineProcess) -> None:
    """The engine's own schema, schema-valid and schema-violating inputs, a few examples per operation."""
    fuzz_schema(engine_client, max(EXAMPLES // 6, 5), engine.alive)
    still_serves(engine_client)


def test_tiny_engine_logged_no_traceback(engine: EngineProcess) -> None:
    """Runs last in this file: nothing the fuzzing sent made the engine log an unhandled exception."""
    engine.alive()
    log = engine.log_path.read_text()
    assert "Traceback" not in log, log[max(log.find("Traceback") - 2000, 0) :][:6000]
