"""The Prometheus registry every wing starts from: its own ``CollectorRegistry`` with the process metrics that every
exporter has, and no ``*_created`` series.

``*_created`` (one series per counter and histogram child) doubled the scrape and nothing reads them;
``disable_created_metrics`` is process-wide in prometheus_client, so it is switched off when this module loads.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, disable_created_metrics

disable_created_metrics()  # type: ignore[no-untyped-call]


def process_registry(auto_describe: bool = False) -> CollectorRegistry:
    """A new registry holding ``process_*`` (``process_resident_memory_bytes``, ``process_cpu_seconds_total``, ...)
    and ``python_info``. Each call makes a fresh one, so several engines or routers in one process (tests) do not
    clash."""
    registry = CollectorRegistry(auto_describe=auto_describe)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
