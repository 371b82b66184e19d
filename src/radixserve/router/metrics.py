"""The router's Prometheus metrics, in a registry of its own (names from ``radixserve.contracts.constants``).

Counters: ``requests_total{model,code}``, ``decisions_total{reason}``, ``retries_total``, ``ejections_total``,
``predicted_cached_tokens_total``, ``actual_cached_tokens_total``, ``cacheable_tokens_total``,
``cache_resyncs_total{reason}``. Gauges: ``worker_inflight_requests{worker}``, ``worker_inflight_tokens{worker}``,
``discovery_age_seconds`` (read at scrape time), ``worker_cache_state{worker,state}`` (``cache_state.py``).
Histograms (seconds): ``request_duration_seconds``, ``ttft_seconds``. All carry the ``radixserve_router_`` prefix;
docs/contracts.md lists them. The registry also holds the process metrics (``process_*``, ``python_info``); no
``*_created`` series.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from radixserve.contracts.constants import ROUTER_METRIC_PREFIX as P
from radixserve.contracts.prometheus import process_registry

# Latency buckets in seconds: sub-millisecond (router-only errors) up to long generations.
_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class RouterMetrics:
    """One router's metrics. ``render()`` gives the exposition text and its content type."""

    def __init__(self, discovery_age: Callable[[], float | None] | None = None) -> None:
        self.registry = process_registry()
        r = self.registry
        self.requests = Counter(
            P + "requests_total", "Requests answered, by model and HTTP status", ["model", "code"], registry=r
        )
        self.decisions = Counter(P + "decisions_total", "Routing decisions, by reason", ["reason"], registry=r)
        self.retries = Counter(P + "retries_total", "Attempts re-sent to the next candidate", registry=r)
        self.ejections = Counter(P + "ejections_total", "Workers ejected by the circuit breaker", registry=r)
        self.predicted_cached = Counter(
            P + "predicted_cached_tokens_total",
            "Prompt tokens the router predicted the chosen worker had cached",
            registry=r,
        )
        self.actual_cached = Counter(
            P + "actual_cached_tokens_total", "Prompt tokens the engines reported as cached", registry=r
        )
        self.cacheable = Counter(
            P + "cacheable_tokens_total",
            "Prompt tokens some routable worker held (or was predicted to) when the request was routed",
            registry=r,
        )
        self.cache_resyncs = Counter(
            P + "cache_resyncs_total",
            "Cache views reloaded from an engine's snapshot, by reason (start, gap, incarnation, seq)",
            ["reason"],
            registry=r,
        )
        self.worker_cache_state = Gauge(
            P + "worker_cache_state",
            "1 for each worker's cache state (exact, degraded, unknown), 0 for the others",
            ["worker", "state"],
            registry=r,
        )
        self.inflight_requests = Gauge(
            P + "worker_inflight_requests", "Requests in flight per worker", ["worker"], registry=r
        )
        self.inflight_tokens = Gauge(
            P + "worker_inflight_tokens",
            "Tokens in flight per worker (uncached prompt + max tokens)",
            ["worker"],
            registry=r,
        )
        self.discovery_age = Gauge(
            P + "discovery_age_seconds", "Seconds since discovery last refreshed the workers", registry=r
        )
        self._discovery_age_fn = discovery_age
        if discovery_age is not None:
            self.discovery_age.set_function(lambda: _or_nan(discovery_age()))
        self.duration = Histogram(
            P + "request_duration_seconds",
            "Time from request to the end of the response",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            P + "ttft_seconds", "Time from request to the first streamed body chunk", buckets=_TTFT_BUCKETS, registry=r
        )

    def forget_worker(self, url: str) -> None:
        """Drop a removed worker's gauges (so /metrics does not list departed pods forever)."""
        for g in (self.inflight_requests, self.inflight_tokens):
            try:
                g.remove(url)
            except KeyError:
                pass

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _or_nan(x: float | None) -> float:
    return float("nan") if x is None else float(x)
