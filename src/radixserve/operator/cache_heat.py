"""Cache-aware scale-in: which engine pod to remove first, from each engine's cache heat.

Kubernetes removes the pods of a ReplicaSet being scaled down in an order it picks (not ready first, then the newest);
among ready pods it deletes those with the lowest ``controller.kubernetes.io/pod-deletion-cost`` annotation first. The
operator owns the signal: it already owns the engine Deployment's replica count (it copies ``spec.replicas``, which
``kubectl scale`` and the HPA write), and it alone sees every engine (each router only sees its own traffic).

- Heat: cached prompt tokens served per minute over the last ``window_s`` (10 min), from each engine pod's counter
  ``radixserve_engine_cached_tokens_total`` (GET ``/metrics`` on the pod's ``http`` port, open without an API key).
  ``CacheHeat.sample`` reads every ready engine pod of an InferenceService; the operator calls it at a reconcile
  (the resync timer, child events) when ``due`` (``min_interval_s`` since the last read), and at every scale-in.
  A pod seen once only (a new pod, an operator restart) is estimated from its counter over its uptime; a pod whose
  metrics never answered counts as cold (0).
- Cost: ``deletion_costs`` gives each pod its heat in whole tokens per minute (capped to int32). The operator writes
  them only right before a scale-in it applies (``Reconciler``: after the dry run, before the Deployment's new replica
  count), and only where the value changed: one write per pod per scale-in, never a write per pod per resync
  (Kubernetes' documentation warns against updating the annotation from a metric often).

Pure apart from ``fetch_cached_tokens`` (HTTP); the clock is passed in.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from radixserve.contracts import constants

__all__ = [
    "DELETION_COST_ANNOTATION",
    "CACHED_TOKENS_METRIC",
    "EnginePod",
    "CacheHeat",
    "deletion_costs",
    "engine_pods",
    "fetch_cached_tokens",
    "parse_cached_tokens",
]

log = logging.getLogger("radixserve.operator.cache_heat")

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
CACHED_TOKENS_METRIC = constants.ENGINE_METRIC_PREFIX + "cached_tokens_total"
HEAT_WINDOW_S = 600.0  # "recently": the cached tokens served in the last 10 minutes
MIN_SAMPLE_INTERVAL_S = 10.0  # at most one read of an InferenceService's engines this often
MAX_COST = 2**31 - 1  # the annotation is an int32
FETCH_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class EnginePod:
    """An engine pod as the heat needs it: ``name``, ``uid``, its ``/metrics`` URL (None without an IP or port),
    when it started (UTC, None if unknown), and the deletion cost it carries now (None: no annotation)."""

    name: str
    uid: str
    metrics_url: str | None
    started_at: datetime | None = None
    cost: int | None = None


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def engine_pods(pods: Iterable[Mapping[str, Any]]) -> list[EnginePod]:
    """The pods (core/v1 Pod JSON) that a scale-in chooses among: not being deleted, sorted by name. The URL is
    ``http://{status.podIP}:{the container port named http}/metrics`` (ENGINE_PORT when none is named) for a ready
    pod, else None (an engine not ready is removed first anyway, and has no heat to read)."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp") or not meta.get("name"):
            continue
        status = pod.get("status") or {}
        ip = status.get("podIP")
        port = constants.ENGINE_PORT
        for c in (pod.get("spec") or {}).get("containers") or []:
            for p in c.get("ports") or []:
                if p.get("name") == constants.HTTP_PORT_NAME and p.get("containerPort"):
                    port = int(p["containerPort"])
        url = None
        if ip and _ready(pod):
            host = f"[{ip}]" if ":" in str(ip) else str(ip)
            url = f"http://{host}:{port}/metrics"
        raw_cost = (meta.get("annotations") or {}).get(DELETION_COST_ANNOTATION)
        try:
            cost = int(raw_cost) if raw_cost is not None else None
        except ValueError:
            cost = None
        started = _parse_time(status.get("startTime")) or _parse_time(meta.get("creationTimestamp"))
        out.append(EnginePod(meta["name"], str(meta.get("uid") or meta["name"]), url, started, cost))
    return sorted(out, key=lambda p: p.name)


def parse_cached_tokens(text: str) -> float | None:
    """The engine's ``radixserve_engine_cached_tokens_total`` in Prometheus text (the sum over its label sets), or
    None when the text has no sample of it."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(CACHED_TOKENS_METRIC):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0].strip() != CACHED_TOKENS_METRIC:
            continue
        try:
            total += float(value)
        except ValueError:
            continue
        found = True
    return total if found else None


def fetch_cached_tokens(url: str, timeout_s: float = FETCH_TIMEOUT_S) -> float | None:
    """GET ``url`` (an engine's ``/metrics``) and return its cached-tokens counter; None on any failure (no answer,
    not 200, no such counter). Never raises."""
    import httpx

    try:
        resp = httpx.get(url, timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as exc:
        log.debug("cache heat: %s: %s", url, exc)
        return None
    if resp.status_code != 200:
        return None
    return parse_cached_tokens(resp.text)


@dataclass
class _Series:
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (monotonic seconds, counter)


class CacheHeat:
    """Per engine pod (by owner and uid): the counter samples of the last ``window_s`` seconds, and the heat they give.

    ``fetch(url) -> counter | None`` reads one pod (default ``fetch_cached_tokens``); ``clock`` gives monotonic
    seconds and ``wall`` the UTC time (a pod's uptime). Thread-safe: the operator reconciles InferenceServices in
    several threads."""

    def __init__(
        self,
        *,
        window_s: float = HEAT_WINDOW_S,
        min_interval_s: float = MIN_SAMPLE_INTERVAL_S,
        fetch: Callable[[str], float | None] = fetch_cached_tokens,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], datetime] | None = None,
    ) -> None:
        import time
        from datetime import UTC

        self.window_s = window_s
        self.min_interval_s = min_interval_s
        self.fetch = fetch
        self.clock = clock or time.monotonic
        self.wall = wall or (lambda: datetime.now(UTC))
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], _Series] = {}  # (owner, pod uid) -> samples
        self._sampled_at: dict[str, float] = {}  # owner -> when its engines were last read

    def due(self, owner: str) -> bool:
        """Whether ``owner``'s engines were last read ``min_interval_s`` ago or more (or never)."""
        with self._lock:
            last = self._sampled_at.get(owner)
        return last is None or self.clock() - last >= self.min_interval_s

    def forget(self, owner: str) -> None:
        """``owner`` (an InferenceService, ``namespace/name``) is gone: drop its samples."""
        with self._lock:
            self._sampled_at.pop(owner, None)
            for key in [k for k in self._series if k[0] == owner]:
                del self._series[key]

    def sample(self, owner: str, pods: list[EnginePod]) -> None:
        """Read the counter of every pod of ``pods`` with a URL, in parallel (each read bounded by its timeout), and
        forget the pods of ``owner`` (``namespace/name``) no longer listed."""
        with self._lock:
            self._sampled_at[owner] = self.clock()
        readable = [p for p in pods if p.metrics_url]
        values: list[float | None] = []
        if readable:
            with ThreadPoolExecutor(max_workers=min(8, len(readable))) as pool:
                values = list(pool.map(lambda p: self.fetch(str(p.metrics_url)), readable))
        now = self.clock()
        with self._lock:
            for pod, value in zip(readable, values):
                if value is not None:
                    self._observe((owner, pod.uid), now, value)
            listed = {p.uid for p in pods}
            for key in [k for k in self._series if k[0] == owner and k[1] not in listed]:
                del self._series[key]

    def _observe(self, key: tuple[str, str], now: float, value: float) -> None:
        series = self._series.setdefault(key, _Series())
        if series.samples and value < series.samples[-1][1]:
            series.samples.clear()  # the counter went back: the engine restarted, its cache with it
        series.samples.append((now, value))
        while len(series.samples) > 2 and now - series.samples[1][0] >= self.window_s:
            series.samples.popleft()  # keep one sample at or before the window's start

    def heat(self, owner: str, pod: EnginePod) -> float:
        """Cached tokens served per minute by ``pod`` (of ``owner``) recently: over its samples of the last
        ``window_s`` seconds; with one sample only, its counter over its uptime (at least a minute); 0 without any."""
        with self._lock:
            series = self._series.get((owner, pod.uid))
            samples = list(series.samples) if series is not None else []
        if len(samples) >= 2:
            (t0, v0), (t1, v1) = samples[0], samples[-1]
            return max(0.0, (v1 - v0) / max(t1 - t0, 1e-9) * 60.0)
        if samples and pod.started_at is not None:
            uptime_s = (self.wall() - pod.started_at).total_seconds()
            return max(0.0, samples[0][1] / max(uptime_s, 60.0) * 60.0)
        return 0.0


def deletion_costs(heats: Mapping[str, float]) -> dict[str, int]:
    """``controller.kubernetes.io/pod-deletion-cost`` per pod name from its heat (cached tokens per minute): the heat
    rounded down, within 0 .. 2**31-1, so the ReplicaSet controller removes the coldest pod first."""
    return {name: min(MAX_COST, max(0, math.floor(h))) for name, h in heats.items()}
