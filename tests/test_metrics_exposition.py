"""``GET /metrics`` of every wing (engine, router, operator) exports the process metrics and no ``*_created`` series.

Regression (issue 11, item 10): each counter and histogram child also exported a ``*_created`` series (a timestamp
nobody reads, doubling the scrape), and no wing exported ``process_resident_memory_bytes`` or CPU time."""

from __future__ import annotations

import asyncio
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from radixserve.contracts import constants
from radixserve.engine.server.http import create_app as engine_app
from radixserve.router.app import create_app as router_app
from radixserve.router.config import RouterArgs

from fake_engine import FakeEngine, ServerThread, load_tokenizer


def check_exposition(text: str, prefix: str) -> None:
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"process_resident_memory_bytes", "process_cpu_seconds", "process_start_time_seconds"} <= names
    assert "python_info" in names
    assert any(n.startswith(prefix) for n in names)
    created = [line for line in text.splitlines() if line.split(" ")[0].split("{")[0].endswith("_created")]
    assert not created, created[:3]
    rss = next(f for f in text_string_to_metric_families(text) if f.name == "process_resident_memory_bytes")
    assert rss.samples[0].value > 10 * 2**20  # a Python process with these libraries: tens of MB at least


def test_engine_metrics_scrape():
    engine = FakeEngine(load_tokenizer())
    engine.metrics.generation_tokens_total.inc(3)  # a counter child that would have had a _created series
    engine.metrics.time_to_first_token_seconds.observe(0.1)
    with ServerThread(engine_app(engine, manage_engine=False)) as url:
        r = httpx.get(url + "/metrics")
    assert r.status_code == 200
    check_exposition(r.text, constants.ENGINE_METRIC_PREFIX)


def test_router_metrics_scrape():
    with ServerThread(router_app(RouterArgs(worker_urls=["http://127.0.0.1:9"], health_interval_s=60))) as url:
        httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x"})  # a 503: counts a request
        r = httpx.get(url + "/metrics")
    assert r.status_code == 200
    check_exposition(r.text, constants.ROUTER_METRIC_PREFIX)


def test_operator_metrics_scrape():
    from radixserve.operator.metrics import OperatorMetrics, serve

    metrics = OperatorMetrics()
    metrics.reconciles.labels(kind="create", result="success").inc()
    metrics.reconcile_duration.observe(0.2)

    async def scrape() -> httpx.Response:
        async with serve(metrics, threading.Event(), host="127.0.0.1", port=0) as port:
            async with httpx.AsyncClient() as client:
                return await client.get(f"http://127.0.0.1:{port}/metrics")

    r = asyncio.run(scrape())
    assert r.status_code == 200
    check_exposition(r.text, constants.OPERATOR_METRIC_PREFIX)
