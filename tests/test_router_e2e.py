"""The local stack end to end: ``radixserve up`` (router + two real engines), the official openai client through the
router, then one engine killed mid-run: requests keep succeeding via the other, the dead engine is ejected, the
stack's supervisor restarts it and the router re-admits it."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from radixserve.contracts import constants

from conftest import ROOT, requires_model

pytestmark = [requires_model, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"


def _free_port_pair() -> int:
    """A port p with p and p+1 free (the engines' base port)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def _pids_with_arg(needle: str) -> list[int]:
    """PIDs whose command line contains every word of ``needle`` in order (Linux /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd:
            pids.append(int(entry))
    return pids


def _workers(router: str) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(router + "/health", timeout=5).json()["workers"]}


def _wait(predicate, timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"radixserve up exited ({proc.returncode}) while waiting for {what}"
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def _ready_lines(log_path: str) -> list[str]:
    with open(log_path, encoding="utf-8") as f:
        return [line.split(": ", 1)[1].rstrip("\n") for line in f if "radixserve.router: ready: " in line]


def _check_ready_line(router: str, port: int, log_path: str, proc: subprocess.Popen) -> None:
    """Until the ready line, /v1/models is a 503 (not an empty list); the line names the real port, model and
    engine count; the first request sent right after it is answered."""
    models = httpx.get(router + "/v1/models", timeout=5)
    if not _ready_lines(log_path):
        assert models.status_code in (200, 503), models.text  # 200: one engine routable, the line awaits both
        if models.status_code == 503:
            assert models.json()["error"]["type"] == "server_error"
            assert "no engine is ready yet (0 of 2 routable: " in models.json()["error"]["message"]
    _wait(lambda: _ready_lines(log_path), 300, "the ready line", proc)
    reply = httpx.post(
        router + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    assert _ready_lines(log_path) == [f"ready: http://127.0.0.1:{port}/v1 — {MODEL} on 2 engines"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port, base = _free_port_pair(), _free_port_pair()
    logfile = open(tmp_path_factory.mktemp("stack") / "up.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixserve",
            "up",
            "--port",
            str(port),
            "--engine-base-port",
            str(base),
            "--engines",
            "2",
            "--num-threads",
            "2",
            "--context-length",
            "2048",
            "--max-total-tokens",
            "8192",
        ],
        cwd=ROOT,
        stdout=logfile,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    router = f"http://127.0.0.1:{port}"
    engines = [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    try:
        # /live, not /health: /health is 503 until an engine is routable.
        _wait(
            lambda: httpx.get(router + constants.ROUTER_LIVE_PATH, timeout=2).status_code == 200, 60, "the router", proc
        )
        _check_ready_line(router, port, logfile.name, proc)
        _wait(
            lambda: all(w["state"] == "healthy" for w in _workers(router).values()) and len(_workers(router)) == 2,
            300,
            "both engines healthy behind the router",
            proc,
        )
        yield {"router": router, "engines": engines, "base": base, "proc": proc, "log": logfile}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        time.sleep(0.5)
        leftover = [p for b in (base, base + 1) for p in _pids_with_arg(f"engine --host 127.0.0.1 --port {b} ")]
        for pid in leftover:
            os.kill(pid, signal.SIGKILL)
        if leftover:
            logfile.seek(0)
            print(logfile.read()[-5000:])
        assert not leftover, "radixserve up left engine processes behind"


def test_openai_client_through_the_router(stack):
    from openai import OpenAI

    client = OpenAI(base_url=stack["router"] + "/v1", api_key="none", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16
    )
    reply = raw.parse()
    assert reply.choices[0].message.content
    assert raw.headers["x-radixserve-worker"] in stack["engines"]
    assert raw.headers["x-radixserve-route-reason"] in constants.ROUTE_REASONS
    assert raw.headers["x-request-id"]

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == reply.choices[0].message.content  # greedy (`up` defaults temperature to 0)

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]

    # The same conversation's next turn lands on the same engine and finds its prefix cached.
    system = "You are a terse geography tutor. " * 40
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Capital of Italy?"}]
    first = client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=8)
    msgs += [
        {"role": "assistant", "content": first.parse().choices[0].message.content},
        {"role": "user", "content": "And of Spain?"},
    ]
    second = client.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=8)
    assert second.headers["x-radixserve-worker"] == first.headers["x-radixserve-worker"]
    assert second.parse().usage.prompt_tokens_details.cached_tokens > 200

    metrics = httpx.get(stack["router"] + "/metrics", timeout=5).text
    assert "radixserve_router_requests_total" in metrics
    assert "radixserve_router_actual_cached_tokens_total" in metrics


def test_killed_engine_is_ejected_then_readmitted(stack):
    from openai import OpenAI

    router = stack["router"]
    client = OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=120)
    failures: list[str] = []
    served_by: list[str] = []
    stop = threading.Event()

    def traffic(worker: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                raw = client.completions.with_raw_response.create(
                    model=MODEL, prompt=f"Request {worker}-{i}: count to five:", max_tokens=4
                )
                raw.parse()
                served_by.append(raw.headers["x-radixserve-worker"])
            except Exception as e:  # noqa: BLE001 - every failure is a test failure, reported below
                failures.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=traffic, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    try:
        _wait(lambda: len(served_by) >= 3, 120, "traffic through the router", stack["proc"])
        # Kill the engine serving this traffic (these short prompts share one routing key, so one engine serves
        # them while it is under the load bound): requests then fail over and passive failures eject it.
        victim = served_by[-1]
        survivor = next(e for e in stack["engines"] if e != victim)
        pids = _pids_with_arg(f"engine --host 127.0.0.1 --port {victim.rsplit(':', 1)[1]} ")
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        killed_at = len(served_by)
        _wait(lambda: _workers(router)[victim]["state"] == "ejected", 60, "the dead engine ejected", stack["proc"])
        time.sleep(3)
        after_kill = served_by[killed_at:]
        assert after_kill and all(w == survivor for w in after_kill[-3:])
        # The supervisor restarts the engine; the router's health probe re-admits it.
        _wait(lambda: _workers(router)[victim]["state"] == "healthy", 300, "the engine re-admitted", stack["proc"])
        # Issue 11: a SIGKILLed engine produced no router log line. One line for each change, with its reason.
        with open(stack["log"].name) as f:
            lines = [line for line in f if f"worker {victim} " in line]
        assert any(f"worker {victim} ejected: " in line for line in lines), lines
        assert any(f"worker {victim} healthy again after" in line for line in lines), lines
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not failures, failures[:5]
    metrics = httpx.get(router + "/metrics", timeout=5).text
    ejections = [line for line in metrics.splitlines() if line.startswith("radixserve_router_ejections_total")]
    assert ejections and float(ejections[0].split()[-1]) >= 1
    # Traffic reaches the re-admitted engine again.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=f"Probe {time.monotonic()}:", max_tokens=2
        )
        if raw.headers["x-radixserve-worker"] == victim:
            break
    else:
        pytest.fail("no request reached the re-admitted engine")
