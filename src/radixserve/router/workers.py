"""The engines behind the router: which there are, what this router has in flight on each, and which may take traffic.

``WorkerPool`` keeps one ``WorkerState`` (``worker_state.py``) per engine URL. ``sync(endpoints)`` applies what
discovery found: new workers start ``pending`` until their ``/health`` and ``/v1/models`` answer; removed workers are
forgotten by the routing policy. ``acquire`` / ``release`` count the requests and tokens in flight on each worker;
``routable`` / ``models`` / ``routable_models`` answer the proxy's and ``/health``'s questions. Each worker's circuit
breaker (``breaker.py``: ``healthy`` / ``ejected`` / ``probing``) takes the probes' and the proxied requests' outcomes
(``record_success`` / ``record_failure``); every state change is one log line with its reason (a WARNING for an
ejection, INFO for admission and recovery). The probes themselves, the model lists they re-read and the tokenizers
they settle are ``probes.py`` ``HealthProber``'s, which the pool owns and starts and stops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from radixserve.router.breaker import PENDING_WARN_S, Breaker, Transition
from radixserve.router.config import RouterArgs
from radixserve.router.metrics import RouterMetrics
from radixserve.router.probes import HealthProber
from radixserve.router.types import Endpoint, RoutingPolicy, WorkerLoad
from radixserve.router.worker_state import WorkerState

__all__ = ["WorkerPool", "WorkerState"]  # WorkerState is re-exported: proxy, relay and the tests import it from here

logger = logging.getLogger("radixserve.router.workers")


class WorkerPool:
    """All known workers, their load and their health; the ``HealthProber`` that probes them is the pool's.

    ``policy`` is told of every membership change; ``extractor`` (the ``PrefixKeyExtractor``) gets each model's
    tokenizer; ``metrics`` gets the in-flight gauges and the ejection counter. ``client`` is used for probes and
    control requests (short timeouts); the proxy uses its own pooled client. Everything runs on the router's event
    loop; no locks.
    """

    def __init__(
        self, args: RouterArgs, policy: RoutingPolicy, extractor: Any, metrics: RouterMetrics, client: httpx.AsyncClient
    ) -> None:
        self.args = args
        self.policy = policy
        self.extractor = extractor
        self.metrics = metrics
        self.client = client
        self.workers: dict[str, WorkerState] = {}
        self._prober = HealthProber(self, args, client, extractor, on_models_changed=self._changed)
        self._routable_cache: dict[str | None, list[WorkerState]] = {}
        self._models_cache: frozenset[str] | None = None
        self.pending_warn_s = PENDING_WARN_S  # seconds pending before the one "not admitted" warning
        # Called by the prober's loop (each round, ~pending_probe_interval_s) with a worker that has requests in flight
        # and has failed its probes for engine_stall_timeout_s, and why: the proxy moves or ends those requests.
        self.on_stall: Callable[[WorkerState, str], None] | None = None

    # ------------------------------------------------------------------------------------------------ membership
    def sync(self, endpoints: dict[str, Endpoint]) -> None:
        """Make the pool hold exactly ``endpoints`` (keyed by URL): add new ones (pending, probed at once), drop gone
        ones (the policy forgets them; requests in flight on them finish)."""
        urls = {url.rstrip("/"): ep for url, ep in endpoints.items()}
        for url in list(self.workers):
            if url not in urls:
                w = self.workers.pop(url)
                w.removed = True
                self.policy.forget_worker(url)
                self.metrics.forget_worker(url)
                logger.info("worker %s removed", url)
        for url, ep in urls.items():
            if url in self.workers:
                self.workers[url].endpoint = ep
                continue
            self.workers[url] = WorkerState(
                url=url,
                endpoint=ep,
                load=WorkerLoad(url=url),
                breaker=Breaker(self.args.eject_after_failures, self.args.readmit_after_s, created_at=time.monotonic()),
                gauges=(self.metrics.inflight_requests.labels(url), self.metrics.inflight_tokens.labels(url)),
            )
            logger.info("worker %s added (pending)", url)
            self._prober.reprobe(self.workers[url])  # probed at once (before start: in the first probe round)
        self.policy.set_workers(list(self.workers))
        self._changed()

    def _changed(self) -> None:
        self._routable_cache.clear()
        self._models_cache = None

    # ------------------------------------------------------------------------------------------------ load
    @staticmethod
    def acquire(w: WorkerState, tokens: int) -> None:
        """Count one request of ``tokens`` (uncached prompt + max tokens) in flight on ``w``."""
        load = w.load
        load.inflight_requests += 1
        load.inflight_tokens += tokens
        # The cost at which other routers' requests on this engine count (WorkerLoad.load); a short memory.
        m = load.mean_request_tokens
        load.mean_request_tokens = float(tokens) if m == 0.0 else 0.9 * m + 0.1 * tokens
        if w.gauges is not None:
            w.gauges[0].set(w.load.inflight_requests)
            w.gauges[1].set(w.load.inflight_tokens)

    @staticmethod
    def release(w: WorkerState, tokens: int) -> None:
        """Undo ``acquire(w, tokens)`` (the response ended, failed, or the client left)."""
        w.load.inflight_requests -= 1
        w.load.inflight_tokens -= tokens
        if w.gauges is not None:
            w.gauges[0].set(w.load.inflight_requests)
            w.gauges[1].set(w.load.inflight_tokens)

    # ------------------------------------------------------------------------------------------------ queries
    def routable(self, model: str | None) -> list[WorkerState]:
        """Workers that may take a request for ``model`` now (healthy or probing, serving it); ``None`` = any model.
        Cached until a state or membership change."""
        cached = self._routable_cache.get(model)
        if cached is not None:
            return cached
        out = [
            w
            for w in self.workers.values()
            if w.breaker.routable and not w.draining and (model is None or model in w.models)
        ]
        self._routable_cache[model] = out
        return out

    def models(self) -> frozenset[str]:
        """Every model some known (non-pending) worker serves, routable or not. Cached until a change."""
        if self._models_cache is None:
            self._models_cache = frozenset(m for w in self.workers.values() for m in w.models)
        return self._models_cache

    def routable_models(self) -> list[str]:
        """Every model some routable worker serves, sorted."""
        return sorted({m for w in self.routable(None) for m in w.models})

    # ------------------------------------------------------------------------------------------------ breaker
    def record_success(self, w: WorkerState, probe: bool = False) -> None:
        """A probe (``probe``) or a proxied request reached ``w`` and got an answer that is not a 5xx. Only a probe
        admits a pending worker or readmits an ejected one: a probe has just re-read its models (regression: a
        time-based readmission sent trial traffic to a restarted engine under its old model list)."""
        now = time.monotonic()
        if probe:
            w.answered_at, w.probe_failing = now, False
            if w.draining and not w.removed:
                w.draining = False
                self._changed()
                logger.info("worker %s serves again (it was draining)", w.url)
        self._on_transition(w, w.breaker.success(now, probe))

    def record_draining(self, w: WorkerState) -> None:
        """``w`` answered a probe or a request with a draining 503 (``x-radixserve-draining``; docs/contracts.md,
        "Graceful drain"): it takes no new request from now on, its requests in flight go on, and since it answers it
        is never counted as stalled. One INFO line when it starts draining."""
        w.answered_at, w.probe_failing = time.monotonic(), False
        if w.draining or w.removed:
            return
        w.draining = True
        self._changed()
        logger.info(
            "worker %s draining: takes no new requests; its %d request(s) in flight here go on",
            w.url,
            w.load.inflight_requests,
        )

    def record_failure(self, w: WorkerState, reason: str, definite: bool = False) -> None:
        """A probe failed, or a proxied request could not connect / got a 5xx before the first byte. ``reason`` is the
        log's wording (``breaker.failure_reason`` / ``status_reason``); ``definite``: the engine answered and refused,
        which ejects a pending worker at once."""
        now = time.monotonic()
        self._on_transition(w, w.breaker.failure(reason, now, definite))
        if w.breaker.overdue(now, self.pending_warn_s) and not w.removed:
            logger.warning(
                "worker %s not admitted after %.0f s: %s (an engine still loading, or none at this URL)",
                w.url,
                now - w.breaker.created_at,
                reason,
            )

    def _on_transition(self, w: WorkerState, t: Transition | None) -> None:
        """One log line per state change (never per failed probe), and the ejection counter."""
        if t is None or w.removed:
            return
        self._changed()
        if t.new == "ejected":
            self.metrics.ejections.inc()
            if t.old == "probing":
                tail = " (failed while on trial)"
            else:
                tail = f" ({t.failures} failures in a row)" if t.failures > 1 else ""
            logger.warning("worker %s ejected: %s%s", w.url, t.reason, tail)
        elif t.new == "probing":  # recovery is good news: INFO (an operator's alert is on the ejection's WARNING)
            logger.info(
                "worker %s probing: it answers its probes again after %.1f s; routable on trial", w.url, t.down_s or 0.0
            )
        elif t.old == "pending":
            logger.info("worker %s ready", w.url)  # the normal start-up admission, not a warning
        else:
            logger.info("worker %s healthy again after %.1f s", w.url, t.down_s or 0.0)

    # ------------------------------------------------------------------------------------------------ probes
    async def start(self) -> None:
        """Start the periodic probe task (idempotent; ``HealthProber.start``)."""
        await self._prober.start()

    async def stop(self) -> None:
        """Stop probes and tokenizer fetches, and wait until they have ended (``HealthProber.stop``)."""
        await self._prober.stop()

    def reprobe(self, w: WorkerState) -> None:
        """Probe ``w`` now, out of turn (its answer says its model list is stale: an engine restarted with another
        model at the same URL). ``HealthProber.reprobe``."""
        self._prober.reprobe(w)

    async def probe_now(self) -> None:
        """Probe every worker once and wait for the answers (tests and operators; ``HealthProber.probe_now``)."""
        await self._prober.probe_now()
