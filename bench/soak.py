"""Soak: ``--duration-s`` at saturation through ``radixserve up`` while its engines are killed or frozen.

Starts ``radixserve up --engines 2`` on free ports with a small KV pool (``--max-total-tokens`` 2,048, so the pool
and the context are small enough to exhaust) and a 1 MiB body limit, or soaks an already-running stack (``--url``).
``--clients`` clients send requests back to back (bench/soak_mix.py: chat and completions, streamed or not,
``json_schema``, ``n`` = 2, forced tool calls, abandoned streams, prompts that fill the pool, prompts too long for
the context, bodies over the limit). Every ``--fault-every-s`` seconds one engine (in turn) is SIGKILLed (``up``
restarts it) or SIGSTOPped for ``--stop-s`` seconds, then SIGCONTed (``--fault kill | stop | both | none``); a
fault waits until every engine is healthy again, so one always serves.

Each answer is ``ok``, a clean error or ``bad`` (bench/soak_check.py); an answer not finished within
``--request-bound-s`` is a hang (bad). Once the soak is over and idle, every engine's ``GET /load`` counts and
``GET /metrics`` gauges (running, queued, KV tokens held) and the router's in-flight counts must be back at their
baseline (``leaked``). Progress goes to stderr; stdout gets ONE JSON line: ``requests``, ``ok``, ``refused`` (the
oversized requests among ok), ``clean_errors``, ``cut_streams`` (those that were streams under way on an engine that
died or stalled: an error event is the only way such a stream can end), ``bad``, ``bad_examples``,
``clean_error_examples``, ``clean_error_rate``, ``leaked``, ``duration_s``, ``faults``, ``by_kind``, ``latency_s``,
``cpu_model``, ``stack``, ``passed``. Exit status 1 when bad > 0, something leaked, the clean-error rate is over
``--max-clean-error-rate`` (0.01) or an engine did not recover.

Usage: ``.venv/bin/python bench/soak.py --duration-s 600 --clients 12 --fault-every-s 60 --fault both``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402

import soak_stack as stack  # noqa: E402
from _common import cpu_info, free_port, make_log  # noqa: E402
from soak_check import SSEReader, Verdict, judge_http_error, judge_json, judge_stream  # noqa: E402
from soak_mix import Mix, Spec, too_big_body  # noqa: E402

log = make_log("soak")
EXAMPLES = 12  # bad / clean examples kept in the report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--clients", type=int, default=12, help="concurrent clients, each back to back (default 12)")
    p.add_argument(
        "--fault",
        choices=["kill", "stop", "both", "none"],
        default="both",
        help="SIGKILL, SIGSTOP (then SIGCONT), both in turn (stop first), or no fault (default both)",
    )
    p.add_argument(
        "--fault-every-s",
        type=float,
        default=60.0,
        help="seconds between faults (default 60; the first comes after this long: a run no longer has none)",
    )
    p.add_argument(
        "--stop-s",
        type=float,
        default=45.0,
        help="seconds a SIGSTOPped engine stays frozen (default 45: past the router's 30 s --engine-stall-timeout-s, "
        "so its stall detection ends the wait)",
    )
    p.add_argument(
        "--request-bound-s",
        type=float,
        default=90.0,
        help="an answer not finished within this many seconds is a hang (default 90: the 30 s stall bound, its "
        "probes and a generation on a loaded CPU)",
    )
    p.add_argument(
        "--max-clean-error-rate",
        type=float,
        default=0.01,
        help="clean errors over this fraction of the requests fail the soak (exit 1; default 0.01)",
    )
    p.add_argument("--url", help="soak this running router (e.g. http://127.0.0.1:8000) instead of starting `up`")
    p.add_argument("--engines", type=int, default=2, help="engines of the stack started (default 2)")
    p.add_argument("--max-total-tokens", type=int, default=2048, help="each engine's KV pool (default 2048)")
    p.add_argument(
        "--body-limit-bytes",
        type=int,
        default=None,
        help="the stack's --max-request-body-bytes (default: 1 MiB for the stack started, 8 MiB with --url)",
    )
    p.add_argument("--seed", type=int, default=0, help="the request mix's random seed (default 0)")
    p.add_argument("--log", type=Path, help="the started stack's output (default: a temporary file)")
    return p.parse_args(argv)


class Tally:
    """Verdicts by kind, latencies, and a few examples of each failure."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.by_kind: dict[str, Counter[str]] = defaultdict(Counter)
        self.latencies: list[float] = []
        self.slowest: dict[str, float] = {}  # kind -> its longest request, seconds
        self.examples: dict[str, list[dict[str, Any]]] = {"bad": [], "clean": []}
        self.refused = 0
        self.cut_streams = 0  # clean errors that are streams ended mid-response (their engine died or stalled)

    def add(self, spec: Spec, verdict: Verdict, rid: str, started: float, ended: float) -> None:
        self.by_kind[spec.kind][verdict.outcome] += 1
        self.latencies.append(ended - started)
        self.slowest[spec.kind] = max(self.slowest.get(spec.kind, 0.0), ended - started)
        if verdict.why.startswith("refused"):
            self.refused += 1
        if verdict.why.startswith(("stream error event 502", "stream error event 504")):
            self.cut_streams += 1
        kept = self.examples.get(verdict.outcome)
        if kept is not None and len(kept) < EXAMPLES:
            t = round(started - self.t0, 1)
            kept.append({"t": t, "s": round(ended - started, 1), "kind": spec.kind, "rid": rid, "why": verdict.why})
            if verdict.outcome == "bad":
                log(f"BAD {spec.kind} (x-request-id {rid}): {verdict.why}")

    def total(self, outcome: str) -> int:
        return sum(c[outcome] for c in self.by_kind.values())


async def send(client: httpx.AsyncClient, url: str, spec: Spec, rid: str, bound_s: float) -> Verdict:
    """One request (``x-request-id`` ``rid``, to find it in the logs), judged; a hang past ``bound_s`` or a
    transport error is bad. A verdict's reason names the engine that answered."""
    kwargs: dict[str, Any] = {"json": spec.body} if spec.content is None else {"content": spec.content}
    kwargs["headers"] = {"content-type": "application/json", "x-request-id": rid}
    try:
        async with asyncio.timeout(bound_s):
            async with client.stream("POST", url + spec.path, **kwargs) as r:
                worker = r.headers.get("x-radixserve-worker")
                verdict = await _judge(spec, r)
                return Verdict(verdict.outcome, f"{verdict.why} [{worker}]") if verdict.why and worker else verdict
    except TimeoutError:
        return Verdict("bad", f"hang: no end within {bound_s:g} s")
    except httpx.HTTPError as e:
        return Verdict("bad", f"transport: {type(e).__name__}: {str(e)[:200]}")


async def _judge(spec: Spec, r: httpx.Response) -> Verdict:
    """Judge the answer ``r`` to ``spec`` (its body read here; an abandoned stream hung up on)."""
    if r.status_code != 200:
        return judge_http_error(spec, r.status_code, dict(r.headers), await r.aread())
    if not r.headers.get("content-type", "").startswith("text/event-stream"):
        if spec.stream:
            return Verdict("bad", f"stream asked, got {r.headers.get('content-type')}")
        try:
            body = json.loads(await r.aread())
        except ValueError as e:
            return Verdict("bad", f"200 with a body that is not JSON: {e}")
        return judge_json(spec, body)
    reader = SSEReader()
    async for chunk in r.aiter_raw():
        if reader.feed(chunk) >= spec.abandon_after > 0:
            break  # hang up mid-stream: the engine must abort the request and free its KV
    abandoned = bool(spec.abandon_after) and "[DONE]" not in reader.payloads
    return judge_stream(spec, reader, abandoned)


async def client_loop(
    i: int, client: httpx.AsyncClient, url: str, args: argparse.Namespace, big: Spec, end: float, tally: Tally
) -> None:
    mix = Mix(args.seed * 1000 + i, big)
    while time.monotonic() < end:
        spec = mix.next()
        started = time.monotonic()
        rid = f"soak-{i}-{uuid.uuid4().hex[:12]}"
        verdict = await send(client, url, spec, rid, args.request_bound_s)
        tally.add(spec, verdict, rid, started, time.monotonic())


async def load(url: str, args: argparse.Namespace, big: Spec, tally: Tally) -> None:
    end = tally.t0 + args.duration_s
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=args.request_bound_s, limits=limits, trust_env=False) as client:

        async def progress() -> None:
            while True:
                await asyncio.sleep(30)
                done = sum(sum(c.values()) for c in tally.by_kind.values())
                log(
                    f"{time.monotonic() - tally.t0:.0f} s: {done} requests, {tally.total('clean')} clean errors, "
                    f"{tally.total('bad')} bad"
                )

        ticker = asyncio.create_task(progress())
        try:
            await asyncio.gather(*(client_loop(i, client, url, args, big, end, tally) for i in range(args.clients)))
        finally:
            ticker.cancel()


def fault_loop(faults: stack.Faults, every_s: float, t0: float, end: float) -> None:
    k = 1
    while not faults.ended.wait(max(0.0, t0 + k * every_s - time.monotonic())):
        if time.monotonic() >= end:
            return
        try:
            faults.inject(time.monotonic() - t0)
        except (httpx.HTTPError, ValueError, KeyError) as e:  # the router did not answer /health: try next turn
            log(f"fault skipped: {type(e).__name__}: {e}")
        k = max(k + 1, int((time.monotonic() - t0) // every_s) + 1)  # a fault that waited long skips missed turns


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 2) if s else 0.0


def soak(url: str, args: argparse.Namespace, body_limit: int) -> dict[str, Any]:
    """Load and faults for ``args.duration_s`` against the router at ``url``, then the leak check; the report."""
    baseline = {w["url"]: stack.engine_counts(w["url"]) for w in stack.workers(url)}
    t0 = time.monotonic()
    tally = Tally(t0)
    faults = stack.Faults(url, args.fault, args.stop_s, log=log)
    thread = None
    if args.fault != "none":
        thread = threading.Thread(target=fault_loop, args=(faults, args.fault_every_s, t0, t0 + args.duration_s))
        thread.start()
    try:
        asyncio.run(load(url, args, too_big_body(body_limit), tally))
    finally:
        faults.ended.set()
        if thread is not None:
            thread.join()
        faults.resume()
    duration = time.monotonic() - t0
    log(f"load over after {duration:.0f} s; waiting for every engine to serve, then checking for leaks")
    if not stack.wait_until(lambda: stack.all_routable(url), faults.recover_s):
        faults.not_recovered.append(f"not every engine healthy {faults.recover_s:g} s after the soak")
    leaked = stack.leaks(url, baseline)
    requests = sum(sum(c.values()) for c in tally.by_kind.values())
    clean = tally.total("clean")
    return {
        "requests": requests,
        "ok": tally.total("ok"),
        "refused": tally.refused,
        "clean_errors": clean,
        "cut_streams": tally.cut_streams,
        "bad": tally.total("bad"),
        "bad_examples": tally.examples["bad"],
        "clean_error_examples": tally.examples["clean"],
        "clean_error_rate": round(clean / requests, 4) if requests else 0.0,
        "leaked": leaked or False,
        "duration_s": round(duration, 1),
        "clients": args.clients,
        "faults": {
            "injected": len(faults.injected),
            "kill": sum(f["kind"] == "kill" for f in faults.injected),
            "stop": sum(f["kind"] == "stop" for f in faults.injected),
            "every_s": args.fault_every_s,
            "stop_s": args.stop_s,
            "list": faults.injected,
            "not_recovered": faults.not_recovered,
        },
        "by_kind": {k: {**v, "max_s": round(tally.slowest[k], 1)} for k, v in sorted(tally.by_kind.items())},
        "latency_s": {
            "p50": percentile(tally.latencies, 0.5),
            "p99": percentile(tally.latencies, 0.99),
            "max": percentile(tally.latencies, 1.0),
        },
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any]
    info: dict[str, Any] = {"url": args.url, "started": args.url is None}
    if args.url:
        url = args.url.rstrip("/")
        if not stack.wait_until(lambda: stack.all_routable(url), 300):
            raise SystemExit(f"soak: not every engine behind {url} was healthy within 300 s")
        report = soak(url, args, args.body_limit_bytes or 8 * 2**20)
    else:
        body_limit = args.body_limit_bytes or 2**20
        port, base = free_port(), free_port(args.engines)
        log_path = args.log or Path(tempfile.mkstemp(prefix="soak-up-", suffix=".log")[1])
        url = f"http://127.0.0.1:{port}"
        info.update(url=url, log=str(log_path))
        log(f"starting radixserve up on {url} ({args.engines} engines from :{base}), output in {log_path}")
        proc = stack.start_up(port, base, args.engines, args.max_total_tokens, body_limit, log_path)
        try:
            if not stack.wait_until(lambda: proc.poll() is not None or stack.all_routable(url), 300):
                raise SystemExit(f"soak: the stack was not ready in 300 s; see {log_path}")
            if proc.poll() is not None:
                raise SystemExit(f"soak: radixserve up exited with {proc.returncode}; see {log_path}")
            log("stack ready")
            report = soak(url, args, body_limit)
        finally:
            info["exit_status"] = stack.stop_up(proc)
        text = log_path.read_text(errors="replace")
        info["tracebacks"] = text.count("Traceback (most recent call last)")
    report["cpu_model"] = cpu_info()["cpu_model"]
    report["stack"] = info
    failed = report["bad"] > 0 or report["leaked"] or report["faults"]["not_recovered"]
    failed = failed or report["clean_error_rate"] > args.max_clean_error_rate
    report["passed"] = not failed
    print(json.dumps(report), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
