"""One request's dispatch, retries and relay, from the ranked candidates to the client's last byte.

``Relay.run`` tries the candidates in rank order, moving on (reason ``retry``) after a connect error, a connection
dropped before any answer, a 503 before the first byte, a 404 from an engine that stopped serving the model, or a
stall (``abandon``), at most ``max_retries`` times; past the ranked candidates, to workers that became routable
while the request waited. Every other answer, 4xx included, is relayed unchanged: the body
goes through chunk by chunk as it arrives (never buffered), with ``x-radixserve-worker`` and
``x-radixserve-route-reason`` added (and ``Retry-After`` on a 429 or 503 without one). SSE events are split on the
blank line and each is forwarded as soon as it is complete. A client that leaves closes the upstream response at
once, so the engine aborts the request and frees its KV cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import Receive, Send

from radixserve.contracts import constants
from radixserve.contracts.sse import SSE_DONE, sse_error
from radixserve.router.breaker import failure_reason, status_reason
from radixserve.router.cache_state import cacheable_tokens
from radixserve.router.inflight import InFlight
from radixserve.router.metrics import RouterMetrics
from radixserve.router.replies import RequestCounter
from radixserve.router.request import ProxiedRequest
from radixserve.router.types import PrefixKey, RouteDecision, RoutingPolicy
from radixserve.router.unavailable import RETRY_SOON_S, retry_after_header
from radixserve.router.upstream import Dropped, Upstream, first_chunk
from radixserve.router.usage import StreamUsage, cached_tokens_in_body
from radixserve.router.workers import WorkerPool, WorkerState

logger = logging.getLogger("radixserve.router.proxy")

_H_WORKER = constants.HEADER_WORKER.encode()
_H_REASON = constants.HEADER_ROUTE_REASON.encode()
_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_RELAYED = frozenset({"content-type", "content-length", "content-encoding", "retry-after"})


@dataclass(frozen=True)
class RelayContext:
    """What every relay of one router shares (built once by ``Proxy``). ``max_retries``: further candidates tried."""

    pool: WorkerPool
    policy: RoutingPolicy
    metrics: RouterMetrics
    upstream: Upstream
    counter: RequestCounter
    inflight: InFlight
    max_retries: int
    decisions: dict[str, Any]  # route reason -> its decisions counter child (labels() costs a lookup per call)


@dataclass(frozen=True)
class Routed:
    """A parsed request with its route: ``path`` to post, its prefix ``key`` (None: nothing to key on), the
    routable ``workers`` and their ``ranked`` order, its prompt length (tokens), upstream ``headers``, and ``t0``,
    its arrival (``perf_counter`` seconds)."""

    request: ProxiedRequest
    path: str
    key: PrefixKey | None
    workers: list[WorkerState]
    ranked: list[RouteDecision]
    prompt_tokens: int
    headers: dict[str, str]
    t0: float


class Relay:
    """Serves one routed request (``run``); counts it in flight on its worker until it ends."""

    def __init__(self, ctx: RelayContext, routed: Routed) -> None:
        self.ctx, self.r = ctx, routed
        self.model = routed.request.model
        self.worker: WorkerState | None = None  # the worker the request is counted on
        self.tokens = 0  # what it counts there: uncached prompt tokens + max output tokens
        self.resp: httpx.Response | None = None
        self.code = 499  # the status the client got (499, nginx's "client closed request": the client left)
        self.counted = False  # an error reply already counted the request
        self.started = False  # the response start was sent
        self.sse = False  # ...and it is an event stream
        self.task: asyncio.Task[Any] | None = None  # the task serving this request (set by run)
        self.left = False  # the client disconnected
        self.abandoned: str | None = None  # why the worker was given up on (a stall), set by ``abandon``
        self._chunks: AsyncIterator[bytes] | None = None  # the stream's body iterator once its first chunk is read
        self._pending: list[RouteDecision] = []  # candidates not tried yet, best first (``_next_candidate``)

    def abandon(self, reason: str) -> None:
        """The worker this request waits on stalled (``InFlight.abandon_stalled``): cancel the wait there; the
        request moves to the next candidate when it has sent the client nothing, else its stream ends with an error
        event."""
        if self.abandoned is None and self.task is not None and not self.task.done():
            self.abandoned = reason
            self.task.cancel()

    def _take_abandon(self) -> str | None:
        """After a CancelledError: the stall reason when ``abandon`` caused it (and not a client that left or a
        shutdown, which win), the cancellation then undone; else None (re-raise)."""
        reason, self.abandoned = self.abandoned, None
        if reason is None or self.left or self.ctx.inflight.shutting_down or self.task is None:
            return None
        self.task.uncancel()
        return reason

    async def run(self, receive: Receive, send: Send) -> None:
        """Dispatch, retry and relay until the answer ends, the client leaves or the router shuts down."""
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        inflight = self.ctx.inflight

        async def watch_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.left = True
                    task.cancel()
                    return

        watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        inflight.add(task)
        try:
            await self._dispatch_and_relay(send)
        except asyncio.CancelledError:
            if self.left:
                task.uncancel()
                self.code = 499
            elif inflight.shutting_down:
                task.uncancel()
                await self._end_for_shutdown(send)
            else:
                raise
        finally:
            inflight.discard(task)
            watcher.cancel()
            await self._close()
            if not self.counted:
                self.ctx.counter.count(self.model, self.code)
            self.ctx.metrics.duration.observe(time.perf_counter() - self.r.t0)

    async def _end_for_shutdown(self, send: Send) -> None:
        try:
            if not self.started:
                await self.ctx.counter.error(send, 503, "the router is shutting down; retry", self.model)
                self.counted = True
                return
            if self.sse:
                await send(
                    {
                        "type": "http.response.body",
                        "more_body": True,
                        "body": sse_error("the router is shutting down", 503) + SSE_DONE,
                    }
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:  # noqa: BLE001 - the client may be gone already
            pass

    async def _close(self) -> None:
        resp, self.resp = self.resp, None
        self._chunks = None
        if self.worker is not None:
            self.ctx.inflight.unwatch(self, self.worker.url)  # first: no stall cancels this request while it closes
        try:
            if resp is not None:
                await resp.aclose()  # unread body: httpx drops the connection, the engine sees the disconnect
        finally:
            if self.worker is not None:
                self.ctx.pool.release(self.worker, self.tokens)
                self.worker = None

    async def _error(self, send: Send, status: int, message: str, worker: str | None = None) -> None:
        await self.ctx.counter.error(send, status, message, self.model, worker=worker)
        self.counted = True

    def _next_candidate(self, by_url: dict[str, WorkerState], tried: set[str]) -> RouteDecision | None:
        """The next worker to try: the ranked ones in order (once one was tried, skipping those ejected or gone
        since), then workers routable now that were not when the request was ranked (readmitted or restarted while
        it waited: regression, a request ranked while one of two engines was down got a 503 when the other stalled,
        with that one healthy again), ranked by the policy. ``by_url`` gains those; None when none is left."""
        r = self.r
        while True:
            while self._pending:
                c = self._pending.pop(0)
                w = by_url[c.worker]
                if c.worker in tried or (tried and (w.removed or not w.breaker.routable)):
                    continue  # ejected or gone since the request was ranked: not worth an attempt
                return c
            fresh = [w for w in self.ctx.pool.routable(self.model) if w.url not in by_url]
            if not fresh:
                return None
            by_url.update((w.url, w) for w in fresh)
            self._pending = self.ctx.policy.rank(r.key, [w.load for w in fresh], r.prompt_tokens + r.request.out_tokens)

    async def _dispatch_and_relay(self, send: Send) -> None:
        ctx, r = self.ctx, self.r
        path = r.path
        by_url = {w.url: w for w in r.workers}
        # What any routable worker holds of this prompt, before this request's own dispatch is recorded.
        cacheable = cacheable_tokens(ctx.policy, r.key, by_url)
        attempts = 1 + ctx.max_retries
        last_error = "no candidate"
        decision: RouteDecision | None = None
        reason = "fallback"
        first: bytes | None = None  # a stream's first chunk, read before the client gets any byte
        tried: set[str] = set()
        answered = False
        self._pending = list(r.ranked)
        candidate = self._next_candidate(by_url, tried)
        while candidate is not None and len(tried) < attempts:
            w = by_url[candidate.worker]
            decision = candidate
            reason = decision.reason if not tried else "retry"
            if tried:
                ctx.metrics.retries.inc()
            tried.add(w.url)
            self.tokens = max(0, r.prompt_tokens - decision.predicted_cached_tokens) + r.request.out_tokens
            self.worker = w
            ctx.pool.acquire(w, self.tokens)
            ctx.inflight.watch(self, w.url)
            if r.key is not None:
                # Recorded at dispatch, not at the answer: a burst sharing a cold prefix follows this request to
                # the engine that is prefilling it (a non-streaming answer starts only when it is done).
                ctx.policy.record(w.url, r.key)
            try:
                resp = await ctx.upstream.send(w.url, path, r.request.content, r.headers)
                self.resp = resp
                if resp.status_code == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
                    # The client gets the stream's headers with its first event: until then a stall or a drop moves
                    # the stream to the next engine, as for a request not answered yet.
                    self._chunks = resp.aiter_raw()
                    first = await first_chunk(self._chunks)
            except asyncio.CancelledError:
                why = self._take_abandon()
                if why is None:
                    raise
                last_error = f"{w.url}: stalled, {why}"
                await self._close()
                candidate = self._next_candidate(by_url, tried)
                continue
            except Dropped as e:
                last_error = f"{w.url}: {e}"
                ctx.pool.record_failure(w, f"{e} on POST {path}")
                await self._close()
                candidate = self._next_candidate(by_url, tried)
                continue
            except httpx.TimeoutException as e:  # read/write/pool timeout: the request may be running; no retry
                ctx.pool.record_failure(w, f"{failure_reason(e)} on POST {path}")
                await self._close()
                await self._error(send, 504, f"the engine {w.url} did not answer in time", worker=w.url)
                return
            except httpx.HTTPError as e:
                ctx.pool.record_failure(w, f"{failure_reason(e)} on POST {path}")
                await self._close()
                await self._error(send, 502, f"the engine {w.url} failed: {type(e).__name__}", worker=w.url)
                return
            retry_why: str | None = None
            if resp.status_code == 503 and resp.headers.get(constants.HEADER_DRAINING):
                ctx.pool.record_draining(w)  # shutting down, not failing: unroutable at once, no ejection
                retry_why = f"{w.url}: draining"
            elif resp.status_code >= 500:
                ctx.pool.record_failure(w, status_reason(resp.status_code, "POST", path))
                if resp.status_code == 503:
                    retry_why = f"{w.url}: answered 503"
            elif resp.status_code == 404 and self.model in w.models:
                # The engine does not serve the model it listed: restarted with another one at the same URL. Re-read
                # its models now and try an engine still serving it; the last candidate's 404 goes to the client.
                ctx.pool.reprobe(w)
                retry_why = f"{w.url}: does not serve {self.model} any more"
            else:
                ctx.pool.record_success(w)
            if retry_why is not None and len(tried) < attempts:
                nxt = self._next_candidate(by_url, tried)  # looked up now: workers routable by now count
                if nxt is not None:
                    last_error = retry_why
                    await self._close()
                    candidate = nxt
                    continue
            answered = True
            break
        if not answered:
            await self._error(send, 503, f"no engine could take the request (last error: {last_error})")
            return

        assert decision is not None and self.resp is not None
        resp = self.resp
        if resp.status_code < 400:
            ctx.decisions[reason].inc()
            if decision.predicted_cached_tokens:
                ctx.metrics.predicted_cached.inc(decision.predicted_cached_tokens)
            if cacheable:
                ctx.metrics.cacheable.inc(cacheable)
        await self._relay(send, resp, decision.worker, reason, first)

    async def _relay(self, send: Send, resp: httpx.Response, worker: str, reason: str, first: bytes | None) -> None:
        ctype = resp.headers.get("content-type", "")
        sse = ctype.startswith("text/event-stream")
        out = [(k.encode(), v.encode("latin-1")) for k, v in resp.headers.items() if k in _RELAYED]
        if sse:
            out = [h for h in out if h[0] != b"content-length"] + _SSE_HEADERS
        if resp.status_code in (429, 503) and "retry-after" not in resp.headers:
            out.append(retry_after_header(RETRY_SOON_S))  # every 429 / 503 from the router says when to retry
        out.append((_H_WORKER, worker.encode()))
        out.append((_H_REASON, reason.encode()))
        self.code = resp.status_code
        self.sse = sse
        ok = resp.status_code == 200
        try:
            await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
            self.started = True
            if sse:
                await self._relay_sse(send, resp, ok, first)
            else:
                parts: list[bytes] = []
                async for chunk in resp.aiter_raw():
                    if ok:
                        parts.append(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if ok:
                    cached = cached_tokens_in_body(b"".join(parts))
                    if cached:
                        self.ctx.metrics.actual_cached.inc(cached)
        except httpx.HTTPError as e:  # the engine died or stalled mid-response: end the stream with an error event
            if self.worker is not None:
                self.ctx.pool.record_failure(self.worker, f"{failure_reason(e)} mid-response on POST {self.r.path}")
            logger.warning("engine %s failed mid-response: %s", worker, type(e).__name__)
            if sse:
                await self._send_event(send, sse_error(f"the engine {worker} failed mid-response", 502) + SSE_DONE)
        except asyncio.CancelledError:
            why = self._take_abandon()
            if why is None:
                raise
            # Stalled mid-response (frozen, or its scheduler dead) for engine_stall_timeout_s: a stream ends with an
            # error event (a non-streaming answer already begun can only be cut short).
            logger.warning("engine %s stalled mid-response: %s", worker, why)
            if not self.started:
                await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
                self.started = True
            if sse:
                message = f"the engine {worker} stopped responding mid-response"
                await self._send_event(send, sse_error(message, 504) + SSE_DONE)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _send_event(send: Send, body: bytes) -> None:
        await send({"type": "http.response.body", "more_body": True, "body": body})

    async def _relay_sse(self, send: Send, resp: httpx.Response, ok: bool, first_chunk: bytes | None) -> None:
        metrics = self.ctx.metrics
        usage = StreamUsage(strip=self.r.request.strip_usage)
        strip = usage.strip
        buf = b""
        first = True
        chunks = self._chunks if self._chunks is not None else resp.aiter_raw()
        pending = first_chunk or None  # read before the response start
        while True:
            if pending is not None:
                chunk, pending = pending, None
            else:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
            if first:
                first = False
                metrics.ttft.observe(time.perf_counter() - self.r.t0)
            if not strip:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not ok:
                continue
            buf += chunk
            end = buf.rfind(b"\n\n")
            if end < 0:
                continue
            complete, buf = buf[: end + 2], buf[end + 2 :]
            complete = usage.events(complete)
            if strip and complete:
                await send({"type": "http.response.body", "body": complete, "more_body": True})
        if strip and buf:
            await send({"type": "http.response.body", "body": buf, "more_body": True})
        if usage.cached_tokens:
            metrics.actual_cached.inc(usage.cached_tokens)
