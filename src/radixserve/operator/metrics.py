"""The operator's Prometheus metrics and its /metrics + /healthz HTTP endpoint (prefix ``radixserve_operator_``).

- ``reconciles_total{kind,result}``: reconciles by trigger ``kind`` (create, update, resume, timer, child) and
  ``result`` (success, invalid_spec, error);
- ``reconcile_errors_total{kind,reason}``: failed reconciles by trigger and error ``reason`` (the HTTP status or the
  exception type, e.g. ``http_409``, ``TemporaryError``);
- ``reconcile_duration_seconds``: histogram of one reconcile's wall time (seconds);
- ``managed_inference_services``: InferenceServices the operator currently reconciles (valid or not);
- the process metrics (``process_resident_memory_bytes``, ``process_cpu_seconds_total``, ..., ``python_info``); no
  ``*_created`` series.

One ``OperatorMetrics`` object per operator, with its own ``CollectorRegistry`` (no process-global metrics), served
by ``serve()`` together with ``/healthz`` on the same port (constants.OPERATOR_METRICS_PORT by default). /healthz is
this module's own probe, not kopf's: 200 once kopf reports it is ready (``ready`` flag set) and while the event loop
that runs kopf answers; 503 before. A wedged event loop fails the probe because the same loop serves it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from radixserve.contracts import constants
from radixserve.contracts.prometheus import process_registry

__all__ = ["OperatorMetrics", "serve", "RECONCILE_KINDS", "RECONCILE_RESULTS"]

P = constants.OPERATOR_METRIC_PREFIX
RECONCILE_KINDS = ("create", "update", "resume", "timer", "child")
RECONCILE_RESULTS = ("success", "invalid_spec", "error")


class OperatorMetrics:
    """The operator's metrics in their own registry (module doc for names and labels)."""

    def __init__(self) -> None:
        self.registry = process_registry(auto_describe=True)
        reconciles, errors = constants.OPERATOR_COUNTERS
        (managed,) = constants.OPERATOR_GAUGES
        (duration,) = constants.OPERATOR_HISTOGRAMS
        self.reconciles = Counter(
            P + reconciles,
            "Reconciles of InferenceServices by trigger and result",
            ["kind", "result"],
            registry=self.registry,
        )
        self.reconcile_errors = Counter(
            P + errors, "Failed reconciles by trigger and error reason", ["kind", "reason"], registry=self.registry
        )
        self.reconcile_duration = Histogram(
            P + duration,
            "Wall time of one reconcile (seconds)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.managed = Gauge(P + managed, "InferenceServices the operator reconciles", registry=self.registry)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def _app(metrics: OperatorMetrics, ready: Any) -> web.Application:
    async def metrics_handler(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        if ready.is_set():
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "starting"}, status=503)

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    return app


@asynccontextmanager
async def serve(
    metrics: OperatorMetrics, ready: Any, host: str = "0.0.0.0", port: int = constants.OPERATOR_METRICS_PORT
) -> AsyncIterator[int]:
    """Serve /metrics and /healthz on ``host:port`` (aiohttp, in the running event loop) for the duration of the
    ``async with``; ``ready`` (an asyncio or threading Event) gates /healthz. Yields the bound port (useful with
    ``port=0``). Raises OSError if the port is taken."""
    runner = web.AppRunner(_app(metrics, ready), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        sockets = getattr(site._server, "sockets", None) or []  # noqa: SLF001 - aiohttp exposes no bound port
        yield sockets[0].getsockname()[1] if sockets else port
    finally:
        await runner.cleanup()
