"""The engines behind the router: what each serves, what this router has in flight on it, and whether it is up.

``WorkerPool`` keeps one ``WorkerState`` per engine URL. ``sync(endpoints)`` applies what discovery found: new workers
start ``pending`` until their ``/health`` and ``/v1/models`` answer; removed workers are forgotten by the routing
policy. An active probe task GETs every worker's ``/health`` each ``health_interval_s`` (a pending one, still loading,
each ``pending_probe_interval_s``, so it is admitted soon after it can serve). A per-worker circuit breaker
(Nygard, *Release It!*; as in Envoy's outlier detection) ejects a worker (``open``) after ``eject_after_failures``
consecutive failures — failed probes, or proxied requests that could not connect or got a 5xx before the first byte —
turns ``half-open`` (routable again, on trial) on the first successful probe after ``readmit_after_s`` and closes on
the next probe or request success; a failure while half-open opens it again at once. Every probe re-reads the
worker's models. For each model the pool fetches the tokenizer once from a
worker serving it (the engine's ``/get_tokenizer_files``; 404 means "no tokenizer": the extractor keeps character
blocks) and hands it to the prefix-key extractor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from radixserve.contracts import constants
from radixserve.router.config import RouterArgs
from radixserve.router.metrics import RouterMetrics
from radixserve.router.types import Endpoint, RoutingPolicy, WorkerLoad

logger = logging.getLogger("radixserve.router.workers")

BreakerState = Literal["pending", "closed", "open", "half-open"]


@dataclass
class WorkerState:
    """One engine. ``load`` is the view a policy ranks (in-flight requests and tokens, updated in place).

    ``state``: ``pending`` (models not read yet), ``closed`` (healthy), ``open`` (ejected), ``half-open`` (on trial);
    ``consecutive_failures`` counts probe and request failures since the last success.
    """

    url: str
    endpoint: Endpoint
    load: WorkerLoad
    models: tuple[str, ...] = ()
    state: BreakerState = "pending"
    consecutive_failures: int = 0
    opened_at: float = 0.0  # monotonic seconds when the breaker last opened
    last_error: str | None = None
    removed: bool = False
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> its /v1/models entry
    gauges: tuple[Any, Any] | None = field(default=None, repr=False)  # (in-flight requests, tokens) gauge children

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


@dataclass
class _TokenizerFetch:
    done: bool = False  # a tokenizer was set, or the engines said they have none (404), or we gave up
    task: asyncio.Task[None] | None = None
    failures: int = 0


# Transient tokenizer-fetch failures tolerated before a model routes on character blocks for good.
_TOKENIZER_ATTEMPTS = 3


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
        self._tokenizers: dict[str, _TokenizerFetch] = {}
        self._probe_task: asyncio.Task[None] | None = None
        self._pending_probes: set[asyncio.Task[None]] = set()
        self._routable_cache: dict[str | None, list[WorkerState]] = {}
        self._models_cache: frozenset[str] | None = None

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
        """Workers that may take a request for ``model`` now (closed or half-open, serving it); ``None`` = any model.
        Cached until a state or membership change."""
        cached = self._routable_cache.get(model)
        if cached is not None:
            return cached
        out = [
            w
            for w in self.workers.values()
            if w.state in ("closed", "half-open") and (model is None or model in w.models)
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
    def _half_open_due(self, w: WorkerState) -> bool:
        return w.state == "open" and time.monotonic() - w.opened_at >= self.args.readmit_after_s

    def record_success(self, w: WorkerState) -> None:
        """A probe or a proxied request reached ``w`` and got an answer that is not a 5xx.

        Re-admission goes through probes: an ejected (open) worker turns half-open (routable, on trial) only on a
        successful probe after ``readmit_after_s`` — a probe that has just re-read its models (regression: a
        time-based half-open sent trial traffic to a restarted engine under its old model list) — and closed on the
        next success."""
        w.consecutive_failures = 0
        w.last_error = None
        if w.state == "half-open":
            w.state = "closed"
            logger.info("worker %s re-admitted", w.url)
            self._changed()
        elif w.state == "open" and self._half_open_due(w):
            w.state = "half-open"
            logger.info("worker %s half-open (on trial)", w.url)
            self._changed()

    def record_failure(self, w: WorkerState, error: str) -> None:
        """A probe failed, or a proxied request could not connect / got a 5xx before the first byte."""
        w.consecutive_failures += 1
        w.last_error = error
        if w.state == "half-open" or (w.state == "closed" and w.consecutive_failures >= self.args.eject_after_failures):
            w.state = "open"
            w.opened_at = time.monotonic()
            self.metrics.ejections.inc()
            logger.warning(
                "worker %s ejected after %d consecutive failures (last: %s)", w.url, w.consecutive_failures, error
            )
            self._changed()

    # ------------------------------------------------------------------------------------------------ probes
    async def start(self) -> None:
        """Start the periodic probe task (idempotent)."""
        if self._probe_task is None:
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def stop(self) -> None:
        """Stop probes and tokenizer fetches."""
        tasks = [
            t
            for t in [self._probe_task, *self._pending_probes, *(f.task for f in self._tokenizers.values())]
            if t is not None
        ]
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
        probing: dict[str, asyncio.Task[None]] = {}
        started: dict[str, float] = {}  # monotonic seconds the worker's last probe started
        pending_s = min(self.args.pending_probe_interval_s, self.args.health_interval_s)
        while True:
            now = time.monotonic()
            wake = now + pending_s  # at least this often: newcomers and probes that ended late are seen soon
            for w in list(self.workers.values()):
                task = probing.get(w.url)
                if task is not None and not task.done():
                    continue
                due = started.get(w.url, now) + (pending_s if w.state == "pending" else self.args.health_interval_s)
                if w.url not in started or now >= due:
                    started[w.url] = now
                    task = probing[w.url] = asyncio.get_running_loop().create_task(self._probe(w))
                    self._pending_probes.add(task)
                    task.add_done_callback(self._pending_probes.discard)
                else:
                    wake = min(wake, due)
            for url in [u for u, t in probing.items() if t.done() and u not in self.workers]:
                del probing[url]
                started.pop(url, None)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))

    async def probe_now(self) -> None:
        """Probe every worker once (tests and operators)."""
        await asyncio.gather(*(self._probe(w) for w in list(self.workers.values())), return_exceptions=True)

    async def _probe(self, w: WorkerState) -> None:
        timeout = min(self.args.connect_timeout_s, max(self.args.health_interval_s, 1.0))
        try:
            r = await self.client.get(w.url + constants.ENGINE_HEALTH_PATH, timeout=timeout)
            if r.status_code != 200:
                raise _ProbeError(f"/health answered {r.status_code}")
            # Every probe re-reads the models: the URL may now be a new process (a restart, a reused pod IP)
            # serving others (regression: the old list stayed; requests for it got the engine's 404).
            models, cards = await self._read_models(w, timeout)
            if models != w.models:
                # Route on new models only once their prefix keys are settled: keys computed on character blocks
                # before the tokenizer arrived would differ from later token-block keys, splitting a conversation's
                # turns across workers (regression: turn 2 of a chat landed on the other engine).
                for model in models:
                    await self._tokenizer_settled(model, w)
                if w.removed:
                    return
                logger.info("worker %s serves %s", w.url, ", ".join(models))
                w.models, w.model_cards = models, cards
                self._changed()
            if w.state == "pending":
                w.state = "closed"
                w.consecutive_failures = 0
                w.last_error = None
                logger.info("worker %s ready", w.url)
                self._changed()
            else:
                self.record_success(w)
        except (httpx.HTTPError, _ProbeError, ValueError, KeyError, TypeError, AttributeError) as e:
            if w.removed:
                return
            if w.state == "pending":
                w.consecutive_failures += 1
                w.last_error = _describe(e)
            else:
                self.record_failure(w, "probe: " + _describe(e))
            return
        for model in w.models:
            self._ensure_tokenizer(model, w)

    async def _read_models(self, w: WorkerState, timeout: float) -> tuple[tuple[str, ...], dict[str, Any]]:
        """``(model ids, model cards by id)`` from ``w``'s ``/v1/models``. Raises _ProbeError / httpx errors."""
        r = await self.client.get(w.url + "/v1/models", headers=self._headers, timeout=timeout)
        if r.status_code != 200:
            raise _ProbeError(f"/v1/models answered {r.status_code}")
        cards = {m["id"]: m for m in r.json().get("data", []) if isinstance(m.get("id"), str)}
        if not cards:
            raise _ProbeError("/v1/models listed no model")
        return tuple(cards), cards

    # ------------------------------------------------------------------------------------------------ tokenizers
    def _ensure_tokenizer(self, model: str, w: WorkerState) -> _TokenizerFetch:
        f = self._tokenizers.setdefault(model, _TokenizerFetch())
        if f.done or (f.task is not None and not f.task.done()) or self.extractor.has_tokenizer(model):
            return f
        f.task = asyncio.get_running_loop().create_task(self._fetch_tokenizer(model, w, f))
        return f

    async def _tokenizer_settled(self, model: str, w: WorkerState) -> None:
        """Wait for this attempt to fetch ``model``'s tokenizer from ``w`` (never raises; a failed attempt leaves
        ``done`` False and the worker pending until the next probe, at most ``_TOKENIZER_ATTEMPTS`` times)."""
        f = self._ensure_tokenizer(model, w)
        if f.task is not None and not f.task.done():
            await asyncio.shield(f.task)
        if not f.done and not self.extractor.has_tokenizer(model):
            raise _ProbeError(f"tokenizer for {model} not loaded yet")

    async def _fetch_tokenizer(self, model: str, w: WorkerState, f: _TokenizerFetch) -> None:
        try:
            r = await self.client.get(
                w.url + constants.ENGINE_TOKENIZER_FILES_PATH,
                headers=self._headers,
                timeout=max(self.args.connect_timeout_s, 30.0),
            )
            if r.status_code == 404:
                f.done = True  # this engine has no servable tokenizer: character blocks for this model
                logger.info("model %s: no tokenizer from %s; routing on character blocks", model, w.url)
                return
            if r.status_code != 200:
                f.failures += 1
                if f.failures >= _TOKENIZER_ATTEMPTS:
                    f.done = True
                    logger.warning(
                        "model %s: %s answered %d for its tokenizer %d times; routing on character blocks",
                        model,
                        w.url,
                        r.status_code,
                        f.failures,
                    )
                return  # try again on the next probe
            files = r.json().get("files")
            if not isinstance(files, dict) or not files:
                f.done = True
                return
            from radixserve.router.tokenizer import tokenizer_from_files

            tokenizer = await asyncio.to_thread(tokenizer_from_files, files)
            self.extractor.set_tokenizer(model, tokenizer)
            f.done = True
            logger.info("model %s: tokenizer from %s; routing on token blocks", model, w.url)
        except asyncio.CancelledError:
            raise
        except httpx.TransportError as e:  # the engine went away mid-fetch: try again on the next probe
            f.failures += 1
            f.done = f.failures >= _TOKENIZER_ATTEMPTS
            logger.info("model %s: tokenizer fetch from %s failed: %s", model, w.url, _describe(e))
        except Exception as e:  # a broken tokenizer must not stop routing: character blocks stay
            f.done = True
            logger.warning(
                "model %s: tokenizer from %s unusable (%s); routing on character blocks", model, w.url, _describe(e)
            )


class _ProbeError(Exception):
    pass


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
