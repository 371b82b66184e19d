"""The engines behind the router: what each serves, what this router has in flight on it, and whether it is up.

``WorkerPool`` keeps one ``WorkerState`` per engine URL. ``sync(endpoints)`` applies what discovery found: new workers
start ``pending`` until their ``/health`` and ``/v1/models`` answer; removed workers are forgotten by the routing
policy. An active probe task GETs every worker's ``/health`` each ``health_interval_s`` (a pending one, still loading,
each ``pending_probe_interval_s``, so it is admitted soon after it can serve). Each worker's circuit breaker
(``breaker.py``: ``healthy`` / ``ejected`` / ``probing``) takes the probes' and the proxied requests' outcomes; every
state change is one log line with its reason (a WARNING for an ejection, INFO for admission and recovery). Every
probe re-reads the worker's models, and a new model is routed on only once its tokenizer is settled
(``tokenizer_fetch.py``: fetched once per model from a worker serving it, for the prefix-key extractor).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from radixserve.contracts import constants
from radixserve.router.breaker import (
    PENDING_WARN_S,
    Breaker,
    Transition,
    WorkerHealthState,
    failure_reason,
    status_reason,
)
from radixserve.router.config import RouterArgs
from radixserve.router.metrics import RouterMetrics
from radixserve.router.tokenizer_fetch import TokenizerFetcher, TokenizerNotReady
from radixserve.router.types import Endpoint, RoutingPolicy, WorkerLoad

logger = logging.getLogger("radixserve.router.workers")


@dataclass
class WorkerState:
    """One engine. ``load`` is the view a policy ranks (in-flight requests and tokens, updated in place).

    ``breaker`` holds its state (``pending``, ``healthy``, ``ejected``, ``probing``) and its consecutive failures.
    """

    url: str
    endpoint: Endpoint
    load: WorkerLoad
    breaker: Breaker = field(default_factory=Breaker)
    models: tuple[str, ...] = ()
    removed: bool = False
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> its /v1/models entry
    gauges: tuple[Any, Any] | None = field(default=None, repr=False)  # (in-flight requests, tokens) gauge children
    answered_at: float = 0.0  # monotonic seconds the last successful probe ended
    probe_failing: bool = False  # the latest probe of the probe loop failed (no answer, or not a healthy one)

    @property
    def state(self) -> WorkerHealthState:
        return self.breaker.state

    @property
    def consecutive_failures(self) -> int:
        return self.breaker.consecutive_failures

    @property
    def last_error(self) -> str | None:
        return self.breaker.last_error

    @property
    def inflight_requests(self) -> int:
        return self.load.inflight_requests

    @property
    def inflight_tokens(self) -> int:
        return self.load.inflight_tokens

    def describe(self) -> dict[str, Any]:
        """The worker as ``/health`` lists it."""
        return {
            "url": self.url,
            "models": list(self.models),
            "state": self.state,
            "inflight_requests": self.load.inflight_requests,
            "inflight_tokens": self.load.inflight_tokens,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
            "pod": self.endpoint.pod,
            "inference_service": self.endpoint.inference_service,
        }


class WorkerPool:
    """All known workers, their health, and their per-model tokenizers.

    ``client`` is used for probes and control requests (short timeouts); the proxy uses its own pooled client.
    Everything runs on the router's event loop; no locks.
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
        self._headers = {"authorization": f"Bearer {args.engine_api_key}"} if args.engine_api_key else {}
        self._tokenizers = TokenizerFetcher(client, self._headers, extractor, max(args.connect_timeout_s, 30.0))
        self._probe_task: asyncio.Task[None] | None = None
        self._pending_probes: set[asyncio.Task[None]] = set()
        self._routable_cache: dict[str | None, list[WorkerState]] = {}
        self._models_cache: frozenset[str] | None = None
        self.pending_warn_s = PENDING_WARN_S  # seconds pending before the one "not admitted" warning
        # Called by the probe loop (each round, ~pending_probe_interval_s) with a worker that has requests in flight
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
            self._spawn(self._probe(self.workers[url]))
        self.policy.set_workers(list(self.workers))
        self._changed()

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop yet (sync before start): the first probe round picks it up
            coro.close()
            return
        self._pending_probes.add(task)
        task.add_done_callback(self._pending_probes.discard)

    def _changed(self) -> None:
        self._routable_cache.clear()
        self._models_cache = None

    # ------------------------------------------------------------------------------------------------ load
    @staticmethod
    def acquire(w: WorkerState, tokens: int) -> None:
        """Count one request of ``tokens`` (uncached prompt + max tokens) in flight on ``w``."""
        w.load.inflight_requests += 1
        w.load.inflight_tokens += tokens
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
        out = [w for w in self.workers.values() if w.breaker.routable and (model is None or model in w.models)]
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
        self._on_transition(w, w.breaker.success(now, probe))

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
        """Start the periodic probe task (idempotent)."""
        if self._probe_task is None:
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def stop(self) -> None:
        """Stop probes and tokenizer fetches."""
        tasks = [t for t in [self._probe_task, *self._pending_probes, *self._tokenizers.tasks()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._probe_task = None

    async def _probe_loop(self) -> None:
        # Each worker's probe runs on its own: a frozen engine (probes timing out) must not delay the probes, and so
        # the ejection or re-admission, of the others (regression: one round waited for the slowest probe). A probe
        # starts once the last one of that worker has ended and its interval has passed since that one started:
        # ``health_interval_s``, or ``pending_probe_interval_s`` for a pending worker (regression: the stack's
        # ready line came up to 5 s after its engines could serve). Ejected workers keep the normal interval.
        # A worker with requests in flight, or a routable one whose last probe failed, is probed every ``fast_s``
        # (a tenth of engine_stall_timeout_s, at most health_interval_s): a freeze is seen within seconds, and a
        # request waits on a stalled engine about engine_stall_timeout_s at most (``_check_stall``).
        probing: dict[str, asyncio.Task[None]] = {}
        started: dict[str, float] = {}  # monotonic seconds the worker's last probe started
        pending_s = min(self.args.pending_probe_interval_s, self.args.health_interval_s)
        fast_s = min(self.args.health_interval_s, max(pending_s, self.args.engine_stall_timeout_s / 10))
        while True:
            now = time.monotonic()
            wake = now + pending_s  # at least this often: newcomers and probes that ended late are seen soon
            for w in list(self.workers.values()):
                self._check_stall(w, now)
                task = probing.get(w.url)
                if task is not None and not task.done():
                    continue
                if w.state == "pending":
                    interval = pending_s
                elif w.load.inflight_requests > 0 or (w.probe_failing and w.breaker.routable):
                    interval = fast_s
                else:
                    interval = self.args.health_interval_s
                due = started.get(w.url, now) + interval
                if w.url not in started or now >= due:
                    started[w.url] = now
                    task = probing[w.url] = asyncio.get_running_loop().create_task(self._tracked_probe(w))
                    self._pending_probes.add(task)
                    task.add_done_callback(self._pending_probes.discard)
                else:
                    wake = min(wake, due)
            for url in [u for u, t in probing.items() if t.done() and u not in self.workers]:
                del probing[url]
                started.pop(url, None)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))

    def _check_stall(self, w: WorkerState, now: float) -> None:
        """Hand ``w`` to ``on_stall`` when it has requests in flight, its latest probe failed and no probe has succeeded
        for ``engine_stall_timeout_s``: frozen (SIGSTOP, a hung process), its scheduler dead, or shutting down for
        longer than that. An engine answering its probes is never stalled, however long its requests take."""
        if self.on_stall is None or not w.probe_failing or w.load.inflight_requests <= 0 or w.removed:
            return
        silent_s = now - w.answered_at
        if silent_s >= self.args.engine_stall_timeout_s:
            self.on_stall(w, f"no successful health probe for {silent_s:.1f} s (last error: {w.last_error})")

    async def _tracked_probe(self, w: WorkerState) -> None:
        """``_probe``, noting whether it failed (``probe_failing``; a success clears it in ``record_success``)."""
        before = w.answered_at
        await self._probe(w)
        if w.answered_at == before:
            w.probe_failing = True

    def reprobe(self, w: WorkerState) -> None:
        """Probe ``w`` now, out of turn (its answer says its model list is stale: an engine restarted with another
        model at the same URL)."""
        self._spawn(self._probe(w))

    async def probe_now(self) -> None:
        """Probe every worker once (tests and operators)."""
        await asyncio.gather(*(self._probe(w) for w in list(self.workers.values())), return_exceptions=True)

    async def _probe(self, w: WorkerState) -> None:
        # Well under engine_stall_timeout_s, so a frozen engine's probes fail (time out) several times before it counts
        # as stalled.
        timeout = min(
            self.args.connect_timeout_s,
            max(self.args.health_interval_s, 1.0),
            max(self.args.engine_stall_timeout_s / 3, 0.5),
        )
        try:
            r = await self.client.get(w.url + constants.ENGINE_HEALTH_PATH, timeout=timeout)
            if r.status_code != 200:
                raise _ProbeError.answered(r.status_code, constants.ENGINE_HEALTH_PATH)
            # Every probe re-reads the models: the URL may now be a new process (a restart, a reused pod IP)
            # serving others (regression: the old list stayed; requests for it got the engine's 404).
            models, cards = await self._read_models(w, timeout)
            if models != w.models:
                # Route on new models only once their prefix keys are settled: keys computed on character blocks
                # before the tokenizer arrived would differ from later token-block keys, splitting a conversation's
                # turns across workers (regression: turn 2 of a chat landed on the other engine).
                for model in models:
                    await self._tokenizers.settled(model, w.url)
                if w.removed:
                    return
                if models != w.models:  # a probe running alongside (discovery's first) may have set them meanwhile
                    logger.info("worker %s serves %s", w.url, ", ".join(models))  # regression: logged twice
                    w.models, w.model_cards = models, cards
                    self._changed()
            self.record_success(w, probe=True)
        except _ProbeError as e:
            self.record_failure(w, str(e), e.definite)
            return
        except TokenizerNotReady as e:
            self.record_failure(w, str(e))
            return
        except httpx.HTTPError as e:  # no answer: not listening (yet, or any more), or too slow
            self.record_failure(w, f"{failure_reason(e)} on GET {_request_path(e)}")
            return
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # an answer, but not an engine's
            self.record_failure(w, f"GET /v1/models: not an OpenAI model list ({_describe(e)})", definite=True)
            return
        for model in w.models:
            self._tokenizers.ensure(model, w.url)

    async def _read_models(self, w: WorkerState, timeout: float) -> tuple[tuple[str, ...], dict[str, Any]]:
        """``(model ids, model cards by id)`` from ``w``'s ``/v1/models``. Raises _ProbeError / httpx errors."""
        r = await self.client.get(w.url + "/v1/models", headers=self._headers, timeout=timeout)
        if r.status_code != 200:
            raise _ProbeError.answered(r.status_code, "/v1/models")
        cards = {m["id"]: m for m in r.json().get("data", []) if isinstance(m.get("id"), str)}
        if not cards:
            raise _ProbeError("GET /v1/models listed no model", definite=True)
        return tuple(cards), cards


class _ProbeError(Exception):
    """A probe got an answer that does not admit the worker. ``definite``: the engine is up and refused (a 4xx, no
    model), as opposed to an engine still starting or shutting down (5xx) or a tokenizer not fetched yet."""

    def __init__(self, reason: str, definite: bool = False) -> None:
        super().__init__(reason)
        self.definite = definite

    @classmethod
    def answered(cls, status: int, path: str) -> _ProbeError:
        return cls(status_reason(status, "GET", path), definite=400 <= status < 500)


def _request_path(e: httpx.HTTPError) -> str:
    try:
        return e.request.url.path
    except RuntimeError:  # an error raised outside a request
        return "?"


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
