"""Chaos: every way an engine fails has a bounded outcome for the router's clients, with real processes — a
``radixserve router`` in front of two engine processes (tests/fake_engine_server.py: the real engine HTTP app on a
FakeEngine, ~2-7 s to start) and a URL where nothing listens.

Failure kinds: (1) an engine killed (SIGKILL), (2) frozen with its connections open (SIGSTOP), (3) slow but alive,
(4) connection refused, (5) restarted with another model at the same URL, (6) a rolling restart of every engine.
The bounds: a request that has sent the client no byte is retried on the other engine (non-streaming ones included),
a stream under way ends with an SSE error event and ``data: [DONE]``, and nothing waits on a sick engine much longer
than ``--engine-stall-timeout-s`` (3 s here); a slow engine that answers its probes is never cut off. Every test
starts from both engines up, healthy and serving ``MODEL`` (``Cluster.restore``; the file's order restarts least).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ROOT, free_port

MODEL = "smollm2-135m-instruct"
OTHER_MODEL = "other-model"
STALL_S = 3.0  # --engine-stall-timeout-s
DELAY_S = 0.05  # seconds per generated token
SERVER = os.path.join(ROOT, "tests", "fake_engine_server.py")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}


def wait_for(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``cond()`` (HTTP errors count as false) every 50 ms until truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = cond()
            if value:
                return value
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


class Engine:
    """One fake-engine process on a fixed port (restarted on the same port)."""

    def __init__(self, name: str, log_dir: Path) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.model = MODEL
        self.frozen = False
        self.starts = 0

    def start(self, model: str = MODEL, prepared: bool = False) -> None:
        """Start the process; ``prepared``: while the old one still serves, up to where it waits for the port."""
        self.model, self.starts = model, self.starts + 1
        path = self.log_dir / f"{self.name}-{self.starts}.log"
        log = open(path, "wb")
        cmd = [sys.executable, SERVER, "--port", str(self.port), "--model", model, "--delay-s", str(DELAY_S)]
        proc = subprocess.Popen(
            cmd + ["--wait-for-port"] * prepared, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=ENV
        )
        log.close()
        if prepared:
            wait_for(lambda: b"waiting for port" in path.read_bytes(), 60, f"engine {self.name}'s restart to load")
            assert proc.poll() is None, path.read_text()
            self.stop()
        self.proc = proc

    def wait_up(self) -> None:
        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"engine {self.name} exited"
            return httpx.get(self.url + "/v1/models", timeout=2).status_code == 200

        wait_for(up, 60, f"engine {self.name} to listen")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.frozen = sig == signal.SIGSTOP

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """End the process (``sig``, then SIGKILL after 10 s) and wait for it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.frozen:
            self.send(signal.SIGCONT)
        self.proc.send_signal(sig)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def stats(self) -> dict[str, list[str]]:
        r = httpx.get(self.url + "/fake_stats", timeout=2)
        r.raise_for_status()
        out: dict[str, list[str]] = r.json()
        return out

    def set_delay(self, s: float) -> None:
        httpx.post(self.url + "/fake_delay", params={"s": s}, timeout=5).raise_for_status()


class Cluster:
    """The router process and its engines ``a``, ``b``, plus ``dead``: a URL where nothing listens (kind 4)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.a, self.b = Engine("a", log_dir), Engine("b", log_dir)
        self.engines = (self.a, self.b)
        self.dead = f"http://127.0.0.1:{free_port()}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.router: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        for e in self.engines:
            e.start()
        log = open(self.log_dir / "router.log", "wb")
        cmd = [sys.executable, "-m", "radixserve", "router", "--port", str(self.port), "--worker-urls"]
        cmd += [self.a.url, self.b.url, self.dead]
        cmd += ["--engine-stall-timeout-s", str(STALL_S), "--health-interval-s", "0.5"]
        cmd += ["--pending-probe-interval-s", "0.2", "--readmit-after-s", "1", "--log-level", "info"]
        # No hot-prefix replicas: a test's prompt stays on the engine it was found to go to (prompt_on).
        cmd += ["--hot-prefix-half-life-s", "0"]
        self.router = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=ENV)
        log.close()
        for e in self.engines:
            e.wait_up()
        self.wait_serving()

    def close(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.kill()
            self.router.wait(10)
        for e in self.engines:
            if e.proc is not None and e.proc.poll() is None:
                if e.frozen:
                    e.proc.send_signal(signal.SIGCONT)
                e.proc.kill()
                e.proc.wait(10)

    def router_log(self) -> str:
        return (self.log_dir / "router.log").read_text(errors="replace")

    # ---- the router's view
    def workers(self) -> dict[str, dict[str, Any]]:
        assert self.router is not None and self.router.poll() is None, "the router exited:\n" + self.router_log()
        return {w["url"]: w for w in httpx.get(self.url + "/health", timeout=5).json()["workers"]}

    def wait_serving(self, timeout_s: float = 60) -> None:
        """Until both engines are healthy in the router, serving what they were started with."""

        def ok() -> bool:
            ws = self.workers()
            return all(ws[e.url]["state"] == "healthy" and ws[e.url]["models"] == [e.model] for e in self.engines)

        wait_for(ok, timeout_s, "both engines healthy in the router")

    def wait_idle(self) -> None:
        """Until the router counts nothing in flight anywhere (no request double-counted, none leaked)."""

        def idle() -> bool:
            return all(w["inflight_requests"] == 0 and w["inflight_tokens"] == 0 for w in self.workers().values())

        wait_for(idle, 15, f"no request in flight in the router: {self.workers()}")

    def restore(self) -> None:
        """Both engines up, unfrozen, serving MODEL at DELAY_S, healthy in the router and nothing in flight."""
        for e in self.engines:
            if e.frozen:
                e.send(signal.SIGCONT)
            if not e.alive() or e.model != MODEL:
                e.stop()
                e.start()
        for e in self.engines:
            e.wait_up()
            e.set_delay(DELAY_S)
        self.wait_serving()
        self.wait_idle()

    def restart(self, e: Engine, model: str = MODEL) -> None:
        """SIGTERM ``e``, start it again on its port (loaded beforehand, so it listens once the old one exited), wait
        until the router routes to it."""
        e.start(model, prepared=True)
        e.wait_up()
        self.wait_serving()

    # ---- clients
    def prompt_on(self, e: Engine) -> str:
        """A fresh prompt the router sends to ``e`` (and keeps sending there: its ring owner, then its cache)."""
        nonce = uuid.uuid4().hex[:8]
        for i in range(200):
            prompt = f"chaos prompt {nonce} {i}"
            r = self.complete(prompt, 1)
            assert r["status"] == 200, r
            if r["worker"] == e.url:
                return prompt
        raise AssertionError(f"no prompt routed to {e.url}")

    def complete(self, prompt: str, max_tokens: int, rid: str | None = None, model: str = MODEL) -> dict[str, Any]:
        """One non-streaming completion: status, worker, route reason, body, seconds taken."""
        t0 = time.monotonic()
        headers = {"x-request-id": rid} if rid else {}
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        r = httpx.post(self.url + "/v1/completions", json=body, headers=headers, timeout=60)
        return {
            "status": r.status_code,
            "worker": r.headers.get("x-radixserve-worker"),
            "reason": r.headers.get("x-radixserve-route-reason"),
            "body": r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text,
            "elapsed": time.monotonic() - t0,
            "done_at": time.monotonic(),
        }

    def stream(
        self, prompt: str, max_tokens: int, rid: str | None = None, first: threading.Event | None = None
    ) -> dict[str, Any]:
        """One streamed completion: status, worker, the ``data:`` payloads (the last is ``[DONE]``), seconds taken."""
        t0 = time.monotonic()
        headers = {"x-request-id": rid} if rid else {}
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        lines: list[str] = []
        with httpx.stream("POST", self.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line.removeprefix("data: "))
                    if first is not None:
                        first.set()
            out = {"status": r.status_code, "worker": r.headers.get("x-radixserve-worker")}
        return {**out, "data": lines, "elapsed": time.monotonic() - t0, "done_at": time.monotonic()}


class Background:
    """Run ``fn`` in a thread; ``result()`` joins it and returns its value (or raises its exception)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in result()
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout_s: float = 60) -> Any:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the request hung"
        if self.error is not None:
            raise self.error
        return self.value


def stream_outcome(s: dict[str, Any]) -> str:
    """``complete`` (finished, then [DONE]) or ``error`` (an error event, then [DONE]); anything else fails."""
    assert s["status"] == 200, s
    data = s["data"]
    assert data and data[-1] == "[DONE]", s
    last = json.loads(data[-2])
    if "error" in last:
        return "error"
    assert last["choices"][0]["finish_reason"] in ("length", "stop"), last
    return "complete"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("chaos"))
    try:
        c.start()
        yield c
        assert "Traceback" not in c.router_log(), c.router_log()
    finally:
        c.close()


def rid() -> str:
    return uuid.uuid4().hex


def aborted(e: Engine, request_id: str) -> bool:
    return any(request_id in r for r in e.stats()["aborted"])


# ------------------------------------------------------------------------------------------------ (4) refused
def test_nothing_listening_is_never_routed_to(cluster: Cluster) -> None:
    cluster.restore()
    ws = cluster.workers()
    assert ws[cluster.dead]["state"] == "pending" and "connection refused" in (ws[cluster.dead]["last_error"] or "")
    results = [cluster.complete(f"refused {i}", 2) for i in range(8)]
    assert all(r["status"] == 200 and r["worker"] != cluster.dead for r in results), results
    assert httpx.get(cluster.url + "/health", timeout=5).json()["status"] == "degraded"


# ------------------------------------------------------------------------------------------------ (3) slow
def test_slow_engine_is_not_cut_off(cluster: Cluster) -> None:
    """An engine slower than the stall timeout per request, but answering its probes: its requests complete there,
    with no retry and no error."""
    cluster.restore()
    pb = cluster.prompt_on(cluster.b)
    cluster.b.set_delay(0.3)
    try:
        stream = Background(lambda: cluster.stream(pb, 15))
        r = cluster.complete(pb, 15)  # 4.5 s, over the 3 s stall bound
        s = stream.result()
    finally:
        cluster.b.set_delay(DELAY_S)
    assert r["status"] == 200 and r["worker"] == cluster.b.url and r["reason"] != "retry", r
    assert r["elapsed"] > STALL_S and r["body"]["usage"]["completion_tokens"] == 15
    assert s["worker"] == cluster.b.url and stream_outcome(s) == "complete" and s["elapsed"] > STALL_S
    assert cluster.workers()[cluster.b.url]["state"] == "healthy"
    cluster.wait_idle()


# ------------------------------------------------------------------------------------------------ (2) frozen
def test_frozen_engine_requests_move_or_end_within_the_stall_bound(cluster: Cluster) -> None:
    cluster.restore()
    a, b = cluster.a, cluster.b
    pa = cluster.prompt_on(a)
    r1_id, s1_id = rid(), rid()
    first = threading.Event()
    s1 = Background(lambda: cluster.stream(pa, 300, s1_id, first))  # 15 s on a healthy engine
    r1 = Background(lambda: cluster.complete(pa, 60, r1_id))  # 3 s on a healthy engine
    assert first.wait(20)
    wait_for(lambda: {r1_id, s1_id} <= set(a.stats()["running"]), 10, "both requests running on a")
    a.send(signal.SIGSTOP)
    t_freeze = time.monotonic()
    try:
        # Sent after the freeze, while the router still routes to a: no byte comes back, so both move too.
        r2 = Background(lambda: cluster.complete(pa, 10))
        s2 = Background(lambda: cluster.stream(pa, 10))
        res1, st1, res2, st2 = r1.result(), s1.result(), r2.result(), s2.result()
        ws = cluster.workers()
    finally:
        a.send(signal.SIGCONT)
    margin = 4.0  # the probe that sees the freeze (<= 0.5 s + its 1 s timeout), the loop's round, a loaded CI box
    # The non-streaming requests: retried on b, done within the bound plus their generation there.
    for res, gen_s in ((res1, 60 * DELAY_S), (res2, 10 * DELAY_S)):
        assert res["status"] == 200 and res["worker"] == b.url and res["reason"] == "retry", res
        assert res["done_at"] - t_freeze < STALL_S + gen_s + margin, res
    # The stream under way: an error event and [DONE], within the bound.
    assert stream_outcome(st1) == "error" and st1["worker"] == a.url
    error = json.loads(st1["data"][-2])["error"]
    assert error["code"] == 504 and a.url in error["message"], error
    assert st1["done_at"] - t_freeze < STALL_S + margin
    # The stream that had not started: moved to b, complete.
    assert st2["worker"] == b.url and stream_outcome(st2) == "complete", st2
    assert ws[a.url]["state"] == "ejected", ws[a.url]
    # a runs again: it finds the router's connections closed and aborts both requests (frees their KV).
    wait_for(lambda: aborted(a, r1_id) and aborted(a, s1_id), 15, "a to abort the abandoned requests")
    assert f"worker {a.url} stalled" in cluster.router_log()
    cluster.wait_serving()
    cluster.wait_idle()


# ------------------------------------------------------------------------------------------------ (1) crash
def test_killed_engine_requests_retried_or_ended(cluster: Cluster) -> None:
    cluster.restore()
    a, b = cluster.a, cluster.b
    pa = cluster.prompt_on(a)
    r1_id = rid()
    first = threading.Event()
    s1 = Background(lambda: cluster.stream(pa, 300, rid(), first))
    r1 = Background(lambda: cluster.complete(pa, 40, r1_id))
    assert first.wait(20)
    wait_for(lambda: r1_id in set(a.stats()["running"]), 10, "the request running on a")
    a.send(signal.SIGKILL)
    t_kill = time.monotonic()
    # Right after the kill the router still routes to a, which now refuses connections: all retried on b.
    burst = [cluster.complete(pa, 2) for _ in range(6)]
    res1, st1 = r1.result(), s1.result()
    assert res1["status"] == 200 and res1["worker"] == b.url and res1["reason"] == "retry", res1
    assert res1["done_at"] - t_kill < 40 * DELAY_S + 4.0
    assert stream_outcome(st1) == "error" and st1["done_at"] - t_kill < 4.0, st1
    assert all(r["status"] == 200 and r["worker"] == b.url for r in burst), burst
    wait_for(lambda: cluster.workers()[a.url]["state"] == "ejected", 15, "a ejected")
    cluster.wait_idle()
    a.stop()  # reap it; restore() starts it again


# ------------------------------------------------------------------------------------------------ (6) rolling
def test_rolling_restart_of_every_engine(cluster: Cluster) -> None:
    cluster.restore()
    stop = threading.Event()

    def plain() -> list[dict[str, Any]]:
        out, i = [], 0
        while not stop.is_set():
            out.append(cluster.complete(f"rolling plain {i % 7}", 10))
            i += 1
        return out

    def streams() -> list[dict[str, Any]]:
        out, i = [], 0
        while not stop.is_set():
            out.append(cluster.stream(f"rolling stream {i % 5}", 30))
            i += 1
        return out

    clients = [Background(plain), Background(plain), Background(streams)]
    try:
        for e in cluster.engines:
            cluster.restart(e)
        time.sleep(0.5)  # a few requests on the fully restarted pair
    finally:
        stop.set()
    plain_results = clients[0].result() + clients[1].result()
    stream_results = clients[2].result()
    assert plain_results and stream_results
    failed = [r for r in plain_results if r["status"] != 200]
    assert not failed, failed
    outcomes = [stream_outcome(s) for s in stream_results]
    assert "complete" in outcomes
    bound = STALL_S + 30 * DELAY_S + 4.0
    slowest = max(plain_results + stream_results, key=lambda r: r["elapsed"])
    assert slowest["elapsed"] < bound, slowest
    workers = {r["worker"] for r in plain_results}
    assert {cluster.a.url, cluster.b.url} <= workers
    cluster.wait_idle()


# ------------------------------------------------------------------------------------------------ (5) other model
def test_engine_restarted_with_another_model(cluster: Cluster) -> None:
    """b comes back at its URL serving another model: requests for the old one go to a (never a 500), the new model
    is routed to b once the router has re-read its models."""
    cluster.restore()
    a, b = cluster.a, cluster.b
    pb = cluster.prompt_on(b)
    stop = threading.Event()

    def client() -> list[dict[str, Any]]:
        out = []
        while not stop.is_set():
            out.append(cluster.complete(pb, 2))
        return out

    bg = Background(client)
    try:
        cluster.restart(b, OTHER_MODEL)
        other = cluster.complete("hello", 2, model=OTHER_MODEL)
    finally:
        stop.set()
    results = bg.result()
    assert other["status"] == 200 and other["worker"] == b.url, other
    assert results and all(r["status"] == 200 and r["worker"] == a.url for r in results[-3:]), results[-3:]
    bad = [r for r in results if r["status"] != 200]
    assert not bad, bad
    # Regression: an engine's 404 for the model it no longer serves is retried on an engine serving it.
    old = cluster.complete(pb, 2)
    assert old["status"] == 200 and old["worker"] == a.url, old
    unknown = cluster.complete("x", 2, model="no-such-model")
    assert unknown["status"] == 404 and unknown["body"]["error"]["type"] == "not_found_error", unknown


# ------------------------------------------------------------------------------------------------ in-process
class _Faulty:
    """ASGI wrapper of an engine app whose generation routes fail as ``mode`` says: ``drop-after-headers`` (a stream's
    headers, then the connection closes before any event) or ``404`` (the engine no longer serves the model)."""

    def __init__(self, app: Any, mode: str) -> None:
        self.app, self.mode, self.hits = app, mode, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/v1/completions":
            await self.app(scope, receive, send)
            return
        self.hits += 1
        if self.mode == "404":
            body = json.dumps({"error": {"message": "The model `x` does not exist.", "type": "not_found_error"}})
            await send(
                {"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": body.encode()})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        raise RuntimeError("engine died after the stream's headers")


@pytest.mark.parametrize("mode", ["drop-after-headers", "404"])
def test_failure_before_the_first_byte_is_retried(mode: str) -> None:
    """Regressions: a stream whose engine sent its headers and then failed ended with an error event instead of being
    retried (the client had no byte yet); an engine restarted with another model answered 404 for the model it had
    listed, and the client got that 404 although another engine served the model."""
    from radixserve.engine.server.http import create_app as engine_app
    from radixserve.router.app import create_app as router_app
    from radixserve.router.config import RouterArgs

    from fake_engine import FakeEngine, ServerThread, load_tokenizer, wait_until

    tok = load_tokenizer()
    faulty = _Faulty(engine_app(FakeEngine(tok), manage_engine=False), mode)
    good = engine_app(FakeEngine(tok), manage_engine=False)
    with ServerThread(faulty) as bad_url, ServerThread(good) as good_url:
        args = RouterArgs(worker_urls=[bad_url, good_url], health_interval_s=0.5, policy="round_robin")
        with ServerThread(router_app(args)) as url:
            assert wait_until(lambda: httpx.get(url + "/health").json()["routable_workers"] == 2, 30)
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": mode != "404"}
            replies = [httpx.post(url + "/v1/completions", json=body, timeout=30) for _ in range(4)]
    assert faulty.hits >= 1
    for r in replies:
        assert r.status_code == 200 and r.headers["x-radixserve-worker"] == good_url, r.text
        assert r.text.endswith("data: [DONE]\n\n") if mode != "404" else r.json()["choices"]
    assert "retry" in {r.headers["x-radixserve-route-reason"] for r in replies}
