"""The health prober: whether each engine answers, what it serves, and whether one with requests on it has stalled.

``HealthProber`` belongs to the ``workers.py`` ``WorkerPool`` and reports every outcome back to it
(``record_success`` / ``record_failure``, which drive the breakers). Its task GETs every worker's ``/health`` each
``health_interval_s``: a pending one (still loading) each ``pending_probe_interval_s``, so it is admitted soon after it
can serve; one with requests in flight, or a routable one whose last probe failed, a tenth of
``engine_stall_timeout_s`` (at most ``health_interval_s``). Each probe then re-reads ``/v1/models``, and a new model
is taken up only once its tokenizer is settled (``tokenizer_fetch.py``: fetched once per model from a worker serving
it, for the prefix-key extractor). A worker with requests in flight whose probes have failed for
``engine_stall_timeout_s`` goes to the pool's ``on_stall``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import httpx

from radixserve.contracts import constants
from radixserve.router.breaker import failure_reason, status_reason
from radixserve.router.config import RouterArgs
from radixserve.router.tokenizer_fetch import TokenizerFetcher, TokenizerNotReady
from radixserve.router.worker_state import WorkerState

# The pool's logger: every line about a worker is in the `radixserve.router.workers` log (docs/contracts.md).
logger = logging.getLogger("radixserve.router.workers")


class ProbedPool(Protocol):
    """What the prober reads of the pool (``workers.WorkerPool``) and reports to it."""

    workers: dict[str, WorkerState]
    # Read at each probe round (the proxy sets it after the pool is built).
    on_stall: Callable[[WorkerState, str], None] | None

    def record_success(self, w: WorkerState, probe: bool = False) -> None: ...

    def record_failure(self, w: WorkerState, reason: str, definite: bool = False) -> None: ...

    def record_draining(self, w: WorkerState) -> None: ...


class HealthProber:
    """Probes the workers of ``pool`` through ``client`` (short timeouts; the engine API key of ``args``, if any, on
    ``/v1/models`` and the tokenizer fetches), and fetches each model's tokenizer for ``extractor``.
    ``on_models_changed`` is called when a probe changed a worker's models (the pool drops its routing caches).
    Everything runs on the router's event loop; no locks.
    """

    def __init__(
        self,
        pool: ProbedPool,
        args: RouterArgs,
        client: httpx.AsyncClient,
        extractor: Any,
        on_models_changed: Callable[[], None],
    ) -> None:
        self.pool = pool
        self.args = args
        self.client = client
        self._on_models_changed = on_models_changed
        self._headers = {"authorization": f"Bearer {args.engine_api_key}"} if args.engine_api_key else {}
        self._tokenizers = TokenizerFetcher(client, self._headers, extractor, max(args.connect_timeout_s, 30.0))
        self._probe_task: asyncio.Task[None] | None = None
        self._pending_probes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Start the periodic probe task (idempotent)."""
        if self._probe_task is None:
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def stop(self) -> None:
        """Stop the probe task, the probes under way and the tokenizer fetches, and wait until they have ended."""
        tasks = [t for t in [self._probe_task, *self._pending_probes, *self._tokenizers.tasks()] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._probe_task = None

    def reprobe(self, w: WorkerState) -> None:
        """Probe ``w`` now, out of turn, in a task of its own: a newcomer, or a worker whose answer says its model list
        is stale (an engine restarted with another model at the same URL). Without a running event loop (``sync``
        before ``start``) nothing is scheduled: the first probe round picks ``w`` up."""
        self._spawn(self.probe(w))

    async def probe_now(self) -> None:
        """Probe every worker once, all at the same time, and wait for them (tests and operators)."""
        await asyncio.gather(*(self.probe(w) for w in list(self.pool.workers.values())), return_exceptions=True)

    async def probe(self, w: WorkerState) -> None:
        """Probe ``w`` once: ``GET /health``, then ``GET /v1/models`` (its models, settling each new one's tokenizer
        first), each timing out after at most a third of ``engine_stall_timeout_s``, ``connect_timeout_s`` and
        ``max(health_interval_s, 1)`` seconds. The outcome goes to the pool's ``record_success(w, probe=True)`` or
        ``record_failure``; a failure is not raised."""
        # Well under engine_stall_timeout_s, so a frozen engine's probes fail (time out) several times before it counts
        # as stalled.
        timeout = min(
            self.args.connect_timeout_s,
            max(self.args.health_interval_s, 1.0),
            max(self.args.engine_stall_timeout_s / 3, 0.5),
        )
        try:
            r = await self.client.get(w.url + constants.ENGINE_HEALTH_PATH, timeout=timeout)
            if r.status_code == 503 and r.headers.get(constants.HEADER_DRAINING):
                self.pool.record_draining(w)  # alive and finishing its requests: unroutable, never stalled
                return
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
                    self._on_models_changed()
            self.pool.record_success(w, probe=True)
        except _ProbeError as e:
            self.pool.record_failure(w, str(e), e.definite)
            return
        except TokenizerNotReady as e:
            self.pool.record_failure(w, str(e))
            return
        except httpx.HTTPError as e:  # no answer: not listening (yet, or any more), or too slow
            self.pool.record_failure(w, f"{failure_reason(e)} on GET {_request_path(e)}")
            return
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # an answer, but not an engine's
            self.pool.record_failure(w, f"GET /v1/models: not an OpenAI model list ({_describe(e)})", definite=True)
            return
        for model in w.models:
            self._tokenizers.ensure(model, w.url)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop yet (sync before start): the first probe round picks it up
            coro.close()
            return
        self._pending_probes.add(task)
        task.add_done_callback(self._pending_probes.discard)

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
            for w in list(self.pool.workers.values()):
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
            for url in [u for u, t in probing.items() if t.done() and u not in self.pool.workers]:
                del probing[url]
                started.pop(url, None)
            await asyncio.sleep(max(0.0, wake - time.monotonic()))

    def _check_stall(self, w: WorkerState, now: float) -> None:
        """Hand ``w`` to ``on_stall`` when it has requests in flight, its latest probe failed and no probe has succeeded
        for ``engine_stall_timeout_s``: frozen (SIGSTOP, a hung process), its scheduler dead, or shutting down for
        longer than that. An engine answering its probes is never stalled, however long its requests take."""
        on_stall = self.pool.on_stall
        if on_stall is None or not w.probe_failing or w.load.inflight_requests <= 0 or w.removed:
            return
        silent_s = now - w.answered_at
        if silent_s >= self.args.engine_stall_timeout_s:
            on_stall(w, f"no successful health probe for {silent_s:.1f} s (last error: {w.last_error})")

    async def _tracked_probe(self, w: WorkerState) -> None:
        """``probe``, noting whether it failed (``probe_failing``; a success clears it in ``record_success``)."""
        before = w.answered_at
        await self.probe(w)
        if w.answered_at == before:
            w.probe_failing = True

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
