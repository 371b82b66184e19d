"""Prometheus metrics of one engine, named as in docs/contracts.md (prefix ``radixserve_engine_``).

Each engine owns its own ``CollectorRegistry`` so several engines can live in one process (tests) without clashes.
The scheduler thread updates them; ``GET /metrics`` renders them.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from radixserve.contracts import constants
from radixserve.contracts.prometheus import process_registry

P = constants.ENGINE_METRIC_PREFIX

# Seconds; spans a sub-10 ms GPU token to a multi-second CPU prefill.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

_DOCS = {
    "num_running_reqs": "Requests in the running (decode) batch",
    "num_queue_reqs": "Requests waiting in the queue",
    "num_used_tokens": "KV cache slots in use (running requests and the radix tree), tokens",
    "num_evictable_tokens": "KV slots held by unlocked radix-tree nodes (evictable), tokens",
    "max_total_num_tokens": "KV pool capacity, tokens",
    "token_usage": "Fraction of the KV pool in use, excluding evictable tokens",
    "num_grammar_queue_reqs": "Requests waiting for grammar compilation",
    "prompt_tokens_total": "Prompt tokens received",
    "cached_tokens_total": "Prompt tokens served from the radix cache (prefix hits)",
    "generation_tokens_total": "Tokens generated",
    "num_requests_total": "Requests finished (any finish reason)",
    "num_aborted_requests_total": "Requests aborted (client disconnect or abort call)",
    "num_retracted_reqs_total": "Requests retracted to the queue when the KV pool ran out",
    "grammar_cache_hits_total": "Grammar compile cache hits",
    "grammar_aborts_total": "Requests aborted by a grammar failure",
    "num_constrained_requests_total": "Requests with a grammar constraint",
    "time_to_first_token_seconds": "Time to first token (TTFT), seconds",
    "inter_token_latency_seconds": "Inter-token latency (ITL), seconds",
    "e2e_request_latency_seconds": "End-to-end request latency, seconds",
    "queue_time_seconds": "Time from arrival to first scheduling, seconds",
    "grammar_compile_seconds": "Grammar compile time, seconds",
}


class EngineMetrics:
    """All engine metrics, each already bound to ``model_name``; attributes carry the contract names.

    Gauges: ``.set(x)``; counters: ``.inc(n)``; histograms: ``.observe(seconds)``. Without ``registry``, a new one
    that also holds the process metrics (``process_*``, ``python_info``).
    """

    # Set by __init__ from the constants.ENGINE_* name lists; declared here for the type checker.
    num_running_reqs: Gauge
    num_queue_reqs: Gauge
    num_used_tokens: Gauge
    num_evictable_tokens: Gauge
    max_total_num_tokens: Gauge
    token_usage: Gauge
    num_grammar_queue_reqs: Gauge
    prompt_tokens_total: Counter
    cached_tokens_total: Counter
    generation_tokens_total: Counter
    num_requests_total: Counter
    num_aborted_requests_total: Counter
    num_retracted_reqs_total: Counter
    grammar_cache_hits_total: Counter
    grammar_aborts_total: Counter
    num_constrained_requests_total: Counter
    time_to_first_token_seconds: Histogram
    inter_token_latency_seconds: Histogram
    e2e_request_latency_seconds: Histogram
    queue_time_seconds: Histogram
    grammar_compile_seconds: Histogram

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        if registry is None:
            # Process metrics only in a registry of our own (a shared one may hold them already: registering twice
            # raises).
            registry = process_registry()
        self.registry = registry
        self.model_name = model_name
        for name in constants.ENGINE_GAUGES:
            g = Gauge(P + name, _DOCS[name], ["model_name"], registry=self.registry)
            setattr(self, name, g.labels(model_name=model_name))
        for name in constants.ENGINE_COUNTERS:
            # prometheus-client appends _total itself.
            c = Counter(P + name.removesuffix("_total"), _DOCS[name], ["model_name"], registry=self.registry)
            setattr(self, name, c.labels(model_name=model_name))
        for name in constants.ENGINE_HISTOGRAMS:
            buckets = _ITL_BUCKETS if name == "inter_token_latency_seconds" else _LATENCY_BUCKETS
            h = Histogram(P + name, _DOCS[name], ["model_name"], buckets=buckets, registry=self.registry)
            setattr(self, name, h.labels(model_name=model_name))

    def render(self) -> tuple[bytes, str]:
        """Prometheus text exposition of this engine's metrics and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
