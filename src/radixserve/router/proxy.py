"""The request path: parse one generation request, rank the engines for it, and hand it to a relay.

``Proxy.endpoint(kind, path)`` is a pure ASGI app for ``POST /v1/chat/completions`` (``chat``), ``/v1/completions``
(``completions``) and ``/generate`` (``generate``). Per request: one parse (``request.py``: a body that is not a JSON
object, or one without a JSON ``Content-Type``, is the engine's 400, word for word; the ``model`` field picks the
workers); the prefix key (``PrefixKeyExtractor.extract``) and a token cost feed ``policy.rank``; ``relay.py`` tries
the candidates in that order and relays the answer byte for byte.

For streams on the OpenAI endpoints the router asks the engine for the usage chunk (``stream_options.include_usage``)
to read ``cached_tokens``, and strips that chunk when the client did not ask for it (``usage.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from radixserve.contracts import constants
from radixserve.contracts.drain import drain_in_flight
from radixserve.contracts.edge import BODY_SCOPE_KEY, REQUEST_ID_SCOPE_KEY
from radixserve.contracts.protocol import random_id
from radixserve.router.config import RouterArgs
from radixserve.router.inflight import InFlight
from radixserve.router.metrics import RouterMetrics
from radixserve.router.relay import Relay, RelayContext, Routed
from radixserve.router.replies import RequestCounter
from radixserve.router.request import RequestError, parse_request
from radixserve.router.types import RequestKind, RoutingPolicy
from radixserve.router.unavailable import Unroutable, unroutable
from radixserve.router.upstream import Upstream
from radixserve.router.workers import WorkerPool, WorkerState

# Bodies over this many bytes are parsed and keyed in a worker thread, so one huge prompt cannot stall the loop.
OFFLOAD_BODY_BYTES = 64 * 1024
# The 503 of a request that reaches a draining router (docs/contracts.md, "Graceful drain").
DRAINING_MESSAGE = "the router is shutting down and takes no new requests; retry"

logger = logging.getLogger("radixserve.router")

_H_CT = b"content-type"


class Proxy:
    """Routes the generation requests. One per app; holds no per-request state.

    ``transport`` is the one pooled transport (httpx's or httpx-aiohttp's) for all upstream requests (the app's shared
    ``httpx.AsyncClient`` wraps the same transport); requests go to it directly, with ``timeout`` applied per request.
    """

    def __init__(
        self,
        args: RouterArgs,
        pool: WorkerPool,
        policy: RoutingPolicy,
        extractor: Any,
        metrics: RouterMetrics,
        transport: httpx.AsyncBaseTransport,
        timeout: httpx.Timeout,
    ) -> None:
        self.args = args
        self.pool = pool
        self.policy = policy
        self.extractor = extractor
        self.metrics = metrics
        self.counter = RequestCounter(metrics)
        self.inflight = InFlight()
        self.upstream = Upstream(transport, timeout, args.engine_api_key)
        self.relays = RelayContext(
            pool=pool,
            policy=policy,
            metrics=metrics,
            upstream=self.upstream,
            counter=self.counter,
            inflight=self.inflight,
            max_retries=args.max_retries,
            decisions={r: metrics.decisions.labels(r) for r in constants.ROUTE_REASONS},
        )
        pool.on_stall = self.abandon_stalled

    def begin_shutdown(self) -> None:
        """End every request in flight now (``InFlight.begin_shutdown``; call on the event loop)."""
        self.inflight.begin_shutdown()

    @property
    def draining(self) -> bool:
        """Whether ``drain`` has begun: readiness fails and new requests get a 503."""
        return self.inflight.draining

    async def drain(self, timeout_s: float) -> None:
        """The router's graceful drain (docs/contracts.md, "Graceful drain"; call on the event loop, once): from now
        on ``/health`` and ``/ready`` fail and every new request gets an OpenAI-format 503 with ``Retry-After: 1``
        and ``x-radixserve-draining: 1``; the requests in flight, streams included, go on for up to ``timeout_s``
        seconds (``--shutdown-timeout``); then those still in flight end as on an immediate shutdown
        (``begin_shutdown``: a 503, or an SSE error event and ``[DONE]``). Cancelled (a second Ctrl-C), it ends
        them at once the same way. Returns when no request is left in flight or they have been told to end."""
        self.inflight.start_draining()
        inflight = self.inflight
        await drain_in_flight(inflight.__len__, inflight.idle, timeout_s, self.begin_shutdown, logger, "ending")

    def abandon_stalled(self, w: WorkerState, why: str) -> None:
        """``w`` stalled (``WorkerPool.on_stall``): its requests give it up (``InFlight.abandon_stalled``)."""
        self.inflight.abandon_stalled(w.url, why)

    def endpoint(self, kind: RequestKind, path: str) -> _Endpoint:
        """The ASGI app serving ``POST path`` as ``kind``."""
        return _Endpoint(self, kind, path)

    def unroutable(self, model: str | None) -> Unroutable:
        """Why no engine (for ``model``, or any) takes a request now: the 503's message and Retry-After."""
        return unroutable(self.pool.workers.values(), self.args.readmit_after_s, model)

    async def handle(self, kind: RequestKind, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one generation request (see the module docstring)."""
        t0 = time.perf_counter()
        if self.inflight.draining:
            await self.counter.error(send, 503, DRAINING_MESSAGE, "unknown", t0=t0, draining=True)
            return
        rid = scope.get(REQUEST_ID_SCOPE_KEY) or random_id()
        raw: bytes = scope.get(BODY_SCOPE_KEY, b"")
        big = len(raw) > OFFLOAD_BODY_BYTES
        parse = (kind, raw, _content_type(scope), self.pool.models(), self.args.default_max_tokens)
        request = await asyncio.to_thread(parse_request, *parse) if big else parse_request(*parse)
        if isinstance(request, RequestError):
            await self._refuse(send, request, t0)
            return
        model = request.model
        workers = self.pool.routable(model)
        if not workers:
            why = self.unroutable(model)
            await self.counter.error(send, 503, why.message, model, t0=t0, retry_after_s=why.retry_after_s)
            return
        if big:
            key = await asyncio.to_thread(self.extractor.extract, kind, request.body, model)
        else:
            key = self.extractor.extract(kind, request.body, model)
        prompt_tokens = key.prompt_tokens if key is not None else 0
        ranked = self.policy.rank(key, [w.load for w in workers], prompt_tokens + request.out_tokens)
        if self.draining:  # began while this request was parsed (a big body, in a thread)
            await self.counter.error(send, 503, DRAINING_MESSAGE, model, t0=t0, draining=True)
            return
        routed = Routed(request, path, key, workers, ranked, prompt_tokens, self.upstream.headers(rid), t0)
        await Relay(self.relays, routed).run(receive, send)

    async def _refuse(self, send: Send, error: RequestError, t0: float) -> None:
        if error.status == 503:  # no engine serves any model
            why = self.unroutable(None)
            await self.counter.error(send, 503, why.message, "unknown", t0=t0, retry_after_s=why.retry_after_s)
            return
        await self.counter.error(send, error.status, error.message, "unknown", error.param, t0=t0)


def _content_type(scope: Scope) -> str | None:
    """The request's ``Content-Type`` header (latin-1, as ASGI carries it), or None."""
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for k, v in headers:
        if k.lower() == _H_CT:
            return v.decode("latin-1")
    return None


class _Endpoint:
    """ASGI app for one proxied route (a class instance, so Starlette mounts it as a raw ASGI app)."""

    def __init__(self, proxy: Proxy, kind: RequestKind, path: str) -> None:
        self.proxy, self.kind, self.path = proxy, kind, path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.proxy.handle(self.kind, self.path, scope, receive, send)
