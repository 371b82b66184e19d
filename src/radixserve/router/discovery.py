"""Where the engines are: a static URL list, or the EndpointSlices of engine Services in Kubernetes.

Both sources hand the router the *full current set* of routable endpoints (``url -> Endpoint``) through one
``on_change`` callback, called on the asyncio loop that ran ``start`` (level-based, never deltas), and report how fresh
that set is (``age_s``, ``is_stale``, ``last_error``) for the router's ``/health``.

Kubernetes discovery follows client-go's reflector (list, then watch from the list's resourceVersion, re-list on 410
Gone or any error, with capped, jittered backoff), plus a periodic full re-list that *replaces* the state, so an event
the watch never delivered (a missed DELETE) cannot leave a dead pod routable for long (a known failure of SGLang's
and vLLM's routers, which only apply watch deltas).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from radixserve.contracts.constants import (
    COMPONENT_ENGINE,
    HTTP_PORT_NAME,
    LABEL_COMPONENT,
    LABEL_INFERENCE_SERVICE,
    LABEL_SERVICE_NAME,
)
from radixserve.contracts.endpointslice import serving_address
from radixserve.contracts.kube import kube_api_client
from radixserve.router.types import Endpoint

if TYPE_CHECKING:  # kubernetes is imported lazily: a router with static URLs never needs it
    import kubernetes
    import urllib3

__all__ = [
    "OnChange",
    "StaticDiscovery",
    "EndpointSliceDiscovery",
    "normalize_url",
    "endpoints_from_slices",
    "LABEL_SERVICE_NAME",
]

logger = logging.getLogger(__name__)

OnChange = Callable[[dict[str, Endpoint]], None]
"""Receives the full current endpoint set, ``url -> Endpoint`` (level-based: not a delta)."""


_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def normalize_url(url: str) -> str:
    """``url`` as the router keys workers: ``http://`` added when no scheme is given, scheme and host lower-cased,
    trailing ``/`` removed. Raises ValueError for anything that is not an http(s) URL with a host (a bad port, a
    query, spaces, another scheme)."""
    if not isinstance(url, str):
        raise ValueError(f"worker URL must be a string, got {type(url).__name__}")
    raw = url.strip()
    if not raw or any(c.isspace() for c in raw):
        raise ValueError(f"invalid worker URL {url!r}")
    if not _SCHEME_RE.match(raw):
        raw = "http://" + raw
    try:
        parts = urlsplit(raw)
        port = parts.port  # raises ValueError on a non-numeric or out-of-range port
    except ValueError as e:
        raise ValueError(f"invalid worker URL {url!r}: {e}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"invalid worker URL {url!r}: scheme must be http or https")
    if not parts.hostname:
        raise ValueError(f"invalid worker URL {url!r}: no host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"invalid worker URL {url!r}: no query, fragment or credentials allowed")
    host = parts.hostname.lower()
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    return f"{parts.scheme.lower()}://{netloc}{parts.path.rstrip('/')}"


class StaticDiscovery:
    """A fixed list of engine URLs (``--worker-urls``). ``start`` reports them once; they never go stale.

    Raises ValueError (from ``__init__``) on an empty list or an invalid URL; duplicates (after normalisation) are
    dropped, order kept.
    """

    kind = "static"

    def __init__(self, urls: Sequence[str]):
        if isinstance(urls, str):
            raise ValueError("urls must be a sequence of URLs, not one string")
        normalized = [normalize_url(u) for u in urls]
        if not normalized:
            raise ValueError("no worker URLs given")
        self.urls: list[str] = list(dict.fromkeys(normalized))
        self.last_error: str | None = None
        self._started_at: float | None = None

    async def start(self, on_change: OnChange) -> None:
        """Call ``on_change`` once (now, on this loop) with every URL."""
        self._started_at = time.monotonic()
        on_change({url: Endpoint(url=url) for url in self.urls})

    async def stop(self) -> None:
        """Nothing runs in the background; kept for the common interface."""

    def age_s(self) -> float | None:
        """0 once started (None before): a static list is as fresh as it will ever be, so an alert on
        ``discovery_age_seconds`` never fires for it (it grew without bound before)."""
        return None if self._started_at is None else 0.0

    def is_stale(self) -> bool:
        """Never: the list cannot change."""
        return False


def _is_selected(obj: dict[str, Any], namespace: str, service: str | None) -> bool:
    """Whether slice ``obj`` belongs to the engine Service(s) we discover (client-side, whatever the server did)."""
    meta = obj.get("metadata") or {}
    if meta.get("namespace") not in (None, namespace):
        return False
    labels = meta.get("labels") or {}
    if service is not None:
        return labels.get(LABEL_SERVICE_NAME) == service
    return LABEL_INFERENCE_SERVICE in labels and labels.get(LABEL_COMPONENT) == COMPONENT_ENGINE


def _slice_port(obj: dict[str, Any], port_name: str) -> int | None:
    """The slice's port named ``port_name``; failing that, its only port when that one is unnamed (a Service with a
    single unnamed port); else None (the slice is skipped)."""
    ports = [p for p in (obj.get("ports") or []) if isinstance(p, dict) and p.get("port")]
    for p in ports:
        if p.get("name") == port_name:
            return int(p["port"])
    if len(ports) == 1 and not ports[0].get("name"):
        return int(ports[0]["port"])
    return None


def endpoints_from_slices(slices: Sequence[dict[str, Any]], port_name: str = HTTP_PORT_NAME) -> dict[str, Endpoint]:
    """Routable endpoints of EndpointSlices (discovery.k8s.io/v1, as JSON dicts): endpoints whose
    ``conditions.ready`` is true or unset (nil means ready, per the API) and that are not ``terminating``; URL
    ``http://{first address}:{port named port_name}`` (IPv6 in brackets). A URL listed by several slices appears once
    (slices taken in name order)."""
    result: dict[str, Endpoint] = {}
    for obj in sorted(slices, key=lambda o: (o.get("metadata") or {}).get("name") or ""):
        port = _slice_port(obj, port_name)
        if port is None:
            continue
        labels = dict((obj.get("metadata") or {}).get("labels") or {})
        for ep in obj.get("endpoints") or []:
            address = serving_address(ep)
            if address is None:
                continue
            host = f"[{address}]" if ":" in address else address
            url = f"http://{host}:{port}"
            if url in result:
                continue
            result[url] = Endpoint(
                url=url,
                service=labels.get(LABEL_SERVICE_NAME),
                inference_service=labels.get(LABEL_INFERENCE_SERVICE),
                pod=(ep.get("targetRef") or {}).get("name"),
                labels=labels,
            )
    return result


def _describe(exc: BaseException) -> str:
    """A one-line, human-sized description of an API/connection error for /health."""
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None)
    if isinstance(reason, BaseException):  # urllib3's MaxRetryError: the underlying cause says what happened
        exc, status, reason = reason, None, None
    if status:
        return f"{type(exc).__name__}: HTTP {status} {reason or ''}".strip()
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text[:300]}".rstrip(": ")


class _Gone(Exception):
    """The watch's resourceVersion expired (410): re-list."""


class EndpointSliceDiscovery:
    """Engine endpoints from Kubernetes EndpointSlices (discovery.k8s.io/v1), kept current by list + watch.

    Scope: the slices of one engine Service (label ``kubernetes.io/service-name=<service>``), or with
    ``all_inference_services`` every slice of an InferenceService's engine Service in ``namespace`` (labels
    ``radixserve.io/inference-service`` and ``app.kubernetes.io/component=engine``, which the EndpointSlice
    controller copies from the Service). The selector is sent to the API server and applied again client-side.

    A daemon thread runs the official client: LIST (state := the listed slices), then WATCH from the list's
    resourceVersion (ADDED/MODIFIED replace a slice by name, DELETED removes it), with ``timeout_seconds`` so each
    watch ends by the next full re-list, due every ``relist_interval_s``, which replaces the whole state. 410 Gone or
    any error: back off (0.2 s doubling, capped at min(5 s, relist_interval_s), jittered) and re-list. On an error the
    last known endpoints are kept (the router's health checks judge the pods) but ``last_error`` is set and, with no
    successful contact for ``stale_after_s``, ``is_stale()`` turns true.

    ``on_change`` is called on the loop that ran ``start``, with the full endpoint set, after the first successful
    list (even if empty) and then only when the set or an endpoint's fields (labels included) change.

    Raises ValueError on an invalid scope or intervals; ``start`` raises KubeConfigError when no ``api_client`` was
    given and none can be configured.
    """

    kind = "kubernetes"

    def __init__(
        self,
        namespace: str,
        service: str | None = None,
        *,
        all_inference_services: bool = False,
        port_name: str = HTTP_PORT_NAME,
        relist_interval_s: float = 30.0,
        stale_after_s: float = 90.0,
        api_client: kubernetes.client.ApiClient | None = None,
    ):
        if not namespace:
            raise ValueError("namespace is required")
        if (service is None) == (not all_inference_services):
            raise ValueError("give exactly one of service=... or all_inference_services=True")
        if service is not None and not service:
            raise ValueError("service must be a non-empty name")
        if not port_name:
            raise ValueError("port_name must be non-empty")
        if not relist_interval_s > 0 or not stale_after_s > 0:
            raise ValueError("relist_interval_s and stale_after_s must be > 0")
        self.namespace = namespace
        self.service = service
        self.all_inference_services = all_inference_services
        self.port_name = port_name
        self.relist_interval_s = float(relist_interval_s)
        self.stale_after_s = float(stale_after_s)
        self.label_selector = (
            f"{LABEL_SERVICE_NAME}={service}"
            if service is not None
            else f"{LABEL_INFERENCE_SERVICE},{LABEL_COMPONENT}={COMPONENT_ENGINE}"
        )
        self.last_error: str | None = None
        self._api = api_client
        self._owns_api = False
        self._connect_timeout_s = 5.0
        self._backoff_initial_s = 0.2
        self._backoff_max_s = min(5.0, self.relist_interval_s)
        # State below is written by the watch thread only; the loop thread reads the scalars.
        self._slices: dict[str, dict[str, Any]] = {}
        self._published: dict[str, tuple[Endpoint, tuple[tuple[str, str], ...]]] | None = None
        self._last_sync: float | None = None  # monotonic time of the last successful list / watch contact
        self._started_at: float | None = None
        self._stop = threading.Event()
        self._watch_lock = threading.Lock()
        self._watch: Any = None  # the kubernetes.watch.Watch in progress, to interrupt it on stop()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_change: OnChange | None = None

    # --- public ---------------------------------------------------------------------------------------------------

    async def start(self, on_change: OnChange) -> None:
        """Start list+watch in a daemon thread and return at once; ``on_change`` follows on this loop."""
        if self._thread is not None:
            raise RuntimeError("already started")
        if self._api is None:
            self._api = kube_api_client()
            self._owns_api = True
        from kubernetes import client

        self._discovery_api = client.DiscoveryV1Api(self._api)
        self._loop = asyncio.get_running_loop()
        self._on_change = on_change
        self._started_at = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"endpointslices-{self.namespace}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the watch thread (interrupting a watch in progress; returns within about 2 s). No ``on_change``
        runs after it returns."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            deadline = time.monotonic() + 2.0
            while thread.is_alive() and time.monotonic() < deadline:
                with self._watch_lock:
                    if self._watch is not None:
                        self._watch.stop()  # shuts the socket down, unblocking the thread's read
                await asyncio.to_thread(thread.join, 0.1)
            if thread.is_alive():  # e.g. a LIST stuck on an unresponsive server: it ends on its own timeout
                logger.warning("EndpointSlice discovery thread still busy after stop(); left to finish (daemon)")
        if self._owns_api and self._api is not None:
            self._api.close()
            self._api, self._owns_api = None, False

    def age_s(self) -> float | None:
        """Seconds since the last successful list or watch contact (None before the first)."""
        return None if self._last_sync is None else time.monotonic() - self._last_sync

    def is_stale(self) -> bool:
        """True when no list or watch has succeeded for ``stale_after_s`` (counted from ``start`` before the first
        success), or when not started."""
        since = self._last_sync if self._last_sync is not None else self._started_at
        return since is None or time.monotonic() - since > self.stale_after_s

    # --- the watch thread -----------------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            try:
                resource_version = self._relist()
                backoff = 0.0
                next_relist = time.monotonic() + self.relist_interval_s
                while not self._stop.is_set() and time.monotonic() < next_relist:
                    resource_version = self._watch_once(resource_version, next_relist)
                continue
            except _Gone:
                logger.info("EndpointSlice watch expired (410 Gone); re-listing")
            except Exception as e:  # connection refused, timeouts, HTTP errors: keep the last state, report, retry
                if self._stop.is_set():
                    break
                self.last_error = _describe(e)
                logger.warning("EndpointSlice discovery in %s: %s (retrying)", self.namespace, self.last_error)
            backoff = min(self._backoff_max_s, max(self._backoff_initial_s, backoff * 2))
            self._stop.wait(backoff * random.uniform(0.5, 1.0))  # jitter: many routers must not re-list in step
        with self._watch_lock:
            self._watch = None

    def _relist(self) -> str:
        """LIST the slices, replace the whole state with them, publish. Returns the list's resourceVersion."""
        # With _preload_content=False the client returns the raw urllib3 response, not the annotated model.
        resp = cast(
            "urllib3.BaseHTTPResponse",
            self._discovery_api.list_namespaced_endpoint_slice(
                self.namespace,
                label_selector=self.label_selector,
                _preload_content=False,
                _request_timeout=(self._connect_timeout_s, max(30.0, self._connect_timeout_s)),
            ),
        )
        try:
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        items = body.get("items") or []
        self._slices = {
            item["metadata"]["name"]: item
            for item in items
            if (item.get("metadata") or {}).get("name") and _is_selected(item, self.namespace, self.service)
        }
        self._synced()
        self.last_error = None
        self._publish()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch_once(self, resource_version: str, next_relist: float) -> str:
        """One WATCH from ``resource_version`` until the server ends it (timeout_seconds, at most until the next
        re-list and half the staleness budget). Returns the last resourceVersion seen."""
        from kubernetes import client, watch

        timeout_s = max(1, math.ceil(min(next_relist - time.monotonic(), self.stale_after_s / 2)))
        w = watch.Watch(return_type=object)  # raw dicts: no model validation to trip on
        with self._watch_lock:
            if self._stop.is_set():
                return resource_version
            self._watch = w
        try:
            stream = w.stream(
                self._discovery_api.list_namespaced_endpoint_slice,
                self.namespace,
                label_selector=self.label_selector,
                resource_version=resource_version or None,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_s,
                _request_timeout=(self._connect_timeout_s, timeout_s + 5.0),
            )
            for event in stream:
                # A server that ignores timeout_seconds while events keep coming must not postpone the re-list.
                if self._stop.is_set() or time.monotonic() >= next_relist:
                    break
                self._synced()
                kind = event.get("type")
                obj = event.get("raw_object") or {}
                meta = obj.get("metadata") or {}
                resource_version = str(meta.get("resourceVersion") or resource_version)
                name = meta.get("name")
                if kind == "BOOKMARK" or not name:
                    continue
                if kind in ("ADDED", "MODIFIED") and _is_selected(obj, self.namespace, self.service):
                    self._slices[name] = obj
                elif kind in ("ADDED", "MODIFIED", "DELETED"):  # deleted, or relabelled out of our scope
                    self._slices.pop(name, None)
                else:
                    continue
                self._publish()
        except client.ApiException as e:
            if e.status == 410:
                raise _Gone() from e
            raise
        finally:
            with self._watch_lock:
                self._watch = None
        if not self._stop.is_set():
            self._synced()  # the server ended the watch normally: the connection was healthy throughout
        return resource_version

    def _synced(self) -> None:
        self._last_sync = time.monotonic()

    def _publish(self) -> None:
        """Post the endpoint set to the loop if it differs from the last one posted (or none was)."""
        endpoints = endpoints_from_slices(list(self._slices.values()), self.port_name)
        fingerprint = {url: (ep, tuple(sorted(ep.labels.items()))) for url, ep in endpoints.items()}
        if fingerprint == self._published:
            return
        self._published = fingerprint
        loop = self._loop
        if loop is None or self._stop.is_set():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, endpoints)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._stop.set()

    def _deliver(self, endpoints: dict[str, Endpoint]) -> None:
        if self._stop.is_set() or self._on_change is None:
            return
        try:
            self._on_change(endpoints)
        except Exception:
            logger.exception("EndpointSlice discovery: on_change failed")
