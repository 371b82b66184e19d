"""The request path: pick the engine for one request and relay its answer byte for byte.

``Proxy.endpoint(kind, path)`` is a pure ASGI app for ``POST /v1/chat/completions`` (``chat``), ``/v1/completions``
(``completions``) and ``/generate`` (``generate``). Per request: one JSON parse (a body that is not a JSON object,
or one without a JSON ``Content-Type``, is the engine's 400, word for word); the ``model`` field picks the workers;
the prefix key (``PrefixKeyExtractor.extract``) and a token cost feed ``policy.rank``; candidates are tried in rank
order, moving on (reason ``retry``) after a connect error, a connection dropped before any answer, or a 503 before
the first byte, at most ``max_retries`` times. Every other answer, 4xx included, is relayed unchanged: the body goes
through chunk by chunk as it arrives (never buffered), with ``x-radixserve-worker`` and ``x-radixserve-route-reason``
added (and ``Retry-After`` on a 429 or 503 without one). A client that leaves closes the upstream response at once,
so the engine aborts the request and frees its KV cache.

For streams on the OpenAI endpoints the router asks the engine for the usage chunk (``stream_options.include_usage``)
to read ``cached_tokens``, and strips that chunk when the client did not ask for it. SSE events are split on the blank
line and each is forwarded as soon as it is complete.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
from starlette.types import Receive, Scope, Send

from radixserve.contracts import constants
from radixserve.contracts.edge import BODY_SCOPE_KEY, REQUEST_ID_SCOPE_KEY
from radixserve.contracts.json_body import CONTENT_TYPE_MESSAGE, is_json_content_type, parse_json_object
from radixserve.contracts.protocol import error_body, random_id
from radixserve.contracts.sse import SSE_DONE, sse_error
from radixserve.router.breaker import failure_reason, status_reason
from radixserve.router.cache_state import cacheable_tokens
from radixserve.router.config import RouterArgs
from radixserve.router.metrics import RouterMetrics
from radixserve.router.types import PrefixKey, RouteDecision, RoutingPolicy
from radixserve.router.unavailable import RETRY_SOON_S, Unroutable, retry_after_header, unroutable
from radixserve.router.workers import WorkerPool, WorkerState

logger = logging.getLogger("radixserve.router.proxy")

Kind = Literal["chat", "completions", "generate"]

# Bodies over this many bytes are parsed and keyed in a worker thread, so one huge prompt cannot stall the loop.
OFFLOAD_BODY_BYTES = 64 * 1024

# `"cached_tokens":123` in the engine's compact JSON. Inside a JSON string the quotes are escaped (\"), so text the
# model generated cannot match.
_CACHED_RE = re.compile(rb'"cached_tokens":\s*(\d+)')
_INDEX_RE = re.compile(rb'"index":\s*(\d+)')
_H_CT = b"content-type"
_H_WORKER = constants.HEADER_WORKER.encode()
_H_REASON = constants.HEADER_ROUTE_REASON.encode()
_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_JSON_CT = (b"content-type", b"application/json")
_RELAYED = frozenset({"content-type", "content-length", "content-encoding", "retry-after"})


class _Dropped(Exception):
    """The upstream connection failed before any answer (connect error / refused / dropped): try the next one."""


class Proxy:
    """Routes and relays the generation requests. One per app; holds no per-request state.

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
        self.transport = transport
        self._extensions = {"timeout": timeout.as_dict()}
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self._auth = f"Bearer {args.engine_api_key}" if args.engine_api_key else None
        self._requests_children: dict[tuple[str, int], Any] = {}
        self._decision_children = {r: metrics.decisions.labels(r) for r in constants.ROUTE_REASONS}
        self._active: set[asyncio.Task[Any]] = set()  # tasks relaying a request (ended early on shutdown)
        self._on_worker: dict[str, set[_Relay]] = {}  # worker URL -> the requests waiting on it (moved on a stall)
        pool.on_stall = self.abandon_stalled
        self.shutting_down = False

    def begin_shutdown(self) -> None:
        """End every request in flight now (call on the event loop): a client gets a 503, or for a stream already
        under way an SSE error event and ``[DONE]`` — instead of a connection cut when the server's graceful
        timeout runs out (regression: streams ended without an event, one traceback logged per stream)."""
        self.shutting_down = True
        for task in list(self._active):
            task.cancel()

    def abandon_stalled(self, w: WorkerState, why: str) -> None:
        """``w`` stopped answering its probes for ``engine_stall_timeout_s`` (``WorkerPool.on_stall``): every request
        waiting on it gives it up (its connection closed, so the engine aborts the request once it runs again). One
        that has sent the client nothing yet is retried on its next candidate; a stream under way ends with an SSE
        error event and ``[DONE]``."""
        relays = [r for r in self._on_worker.get(w.url, ()) if r.abandoned is None]
        if not relays:
            return
        logger.warning("worker %s stalled: %s; giving up %d request(s) on it", w.url, why, len(relays))
        for r in relays:
            r.abandon(why)

    def _watch(self, relay: _Relay, w: WorkerState) -> None:
        self._on_worker.setdefault(w.url, set()).add(relay)

    def _unwatch(self, relay: _Relay, w: WorkerState) -> None:
        waiting = self._on_worker.get(w.url)
        if waiting is not None:
            waiting.discard(relay)
            if not waiting:
                del self._on_worker[w.url]

    def endpoint(self, kind: Kind, path: str) -> _Endpoint:
        """The ASGI app serving ``POST path`` as ``kind``."""
        return _Endpoint(self, kind, path)

    # ------------------------------------------------------------------------------------------------ helpers
    def _count(self, model: str, code: int) -> None:
        child = self._requests_children.get((model, code))
        if child is None:
            child = self._requests_children[(model, code)] = self.metrics.requests.labels(model, str(code))
        child.inc()

    async def _error(
        self,
        send: Send,
        status: int,
        message: str,
        model: str,
        param: str | None = None,
        t0: float | None = None,
        worker: str | None = None,
        retry_after_s: int = RETRY_SOON_S,
    ) -> None:
        """Answer an OpenAI error body and count it (with its duration when ``t0``, the arrival time, is given;
        naming the engine at fault in ``x-radixserve-worker`` when ``worker`` is; a 429 or 503 with
        ``Retry-After: retry_after_s``)."""
        body = json.dumps(error_body(message, status, param)).encode()
        headers = [_JSON_CT, (b"content-length", str(len(body)).encode())]
        if status in (429, 503):
            headers.append(retry_after_header(retry_after_s))
        if worker is not None:
            headers.append((_H_WORKER, worker.encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._count(model, status)
        if t0 is not None:
            self.metrics.duration.observe(time.perf_counter() - t0)

    @staticmethod
    def _parse(raw: bytes) -> dict[str, Any] | str:
        """The JSON object in ``raw``, or the message of the 400 to answer (the engine's, word for word)."""
        return parse_json_object(raw)

    def unroutable(self, model: str | None) -> Unroutable:
        """Why no engine (for ``model``, or any) takes a request now: the 503's message and Retry-After."""
        return unroutable(self.pool.workers.values(), self.args.readmit_after_s, model)

    def _resolve_model(self, kind: Kind, body: dict[str, Any]) -> tuple[int, str]:
        """(0, model) or (HTTP status, error message; 503: no engine serves any model, see ``unroutable``)."""
        model = body.get("model")
        served = self.pool.models()
        if model is not None and not isinstance(model, str):
            return 400, "model must be a string"
        if model is None:
            if len(served) == 1:
                return 0, next(iter(served))
            if not served:
                return 503, self.unroutable(None).message
            return 400, f"model is required: this router serves {', '.join(sorted(served))}"
        if model not in served:
            if not served:
                return 503, self.unroutable(None).message
            return 404, f"The model `{model}` does not exist."
        return 0, model

    def _cost(self, kind: Kind, body: dict[str, Any]) -> int:
        """Tokens this request may generate: max tokens (or ``default_max_tokens``) x samples x prompts."""
        n: object = 1  # client JSON: validated below
        mt: object
        prompts = 1
        if kind == "generate":
            sp = body.get("sampling_params")
            if isinstance(sp, list):
                sp = sp[0] if sp and isinstance(sp[0], dict) else None
            mt = sp.get("max_new_tokens") if isinstance(sp, dict) else None
            if isinstance(sp, dict):
                n = sp.get("n", 1)
            text, ids = body.get("text"), body.get("input_ids")
            if isinstance(text, list):
                prompts = len(text)
            elif isinstance(ids, list) and ids and isinstance(ids[0], list):
                prompts = len(ids)
        else:
            mt = body.get("max_completion_tokens")
            if mt is None:
                mt = body.get("max_tokens")
            n = body.get("n", 1)
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 0:
            mt = self.args.default_max_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            n = 1
        return mt * n * max(prompts, 1)

    # ------------------------------------------------------------------------------------------------ request
    async def handle(self, kind: Kind, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one generation request (see the module docstring)."""
        t0 = time.perf_counter()
        rid = scope.get(REQUEST_ID_SCOPE_KEY) or random_id()
        raw: bytes = scope.get(BODY_SCOPE_KEY, b"")
        big = len(raw) > OFFLOAD_BODY_BYTES
        body = await asyncio.to_thread(self._parse, raw) if big else self._parse(raw)
        if isinstance(body, str):
            await self._error(send, 400, body, "unknown", t0=t0)
            return
        if not is_json_content_type(_content_type(scope)):
            # The engine's 400 for a JSON object it will not read as JSON (regression: `curl -d` bodies, form-encoded,
            # got 200 through the router, as it sends the engine application/json whatever the client sent).
            await self._error(send, 400, CONTENT_TYPE_MESSAGE, "unknown", t0=t0)
            return
        status, model = self._resolve_model(kind, body)
        if status:
            param = "model" if status in (400, 404) else None
            retry = self.unroutable(None).retry_after_s if status == 503 else RETRY_SOON_S
            await self._error(send, status, model, "unknown", param, t0=t0, retry_after_s=retry)
            return
        workers = self.pool.routable(model)
        if not workers:
            why = self.unroutable(model)
            await self._error(send, 503, why.message, model, t0=t0, retry_after_s=why.retry_after_s)
            return
        if big:
            key = await asyncio.to_thread(self.extractor.extract, kind, body, model)
        else:
            key = self.extractor.extract(kind, body, model)
        out_tokens = self._cost(kind, body)
        prompt_tokens = key.prompt_tokens if key is not None else 0
        ranked = self.policy.rank(key, [w.load for w in workers], prompt_tokens + out_tokens)

        stream = body.get("stream") is True
        strip_usage = False
        content = raw
        if stream and kind != "generate":
            so = body.get("stream_options")
            # The engine reads include_usage strictly (true / false only): a malformed stream_options, or a flag
            # such as "false" or 1, is left for the engine to refuse (400), never overwritten.
            if so is None or (isinstance(so, dict) and so.get("include_usage", False) is False):
                # Ask for the usage chunk (it carries cached_tokens) and hide it from this client.
                body["stream_options"] = {**(so or {}), "include_usage": True}
                # ensure_ascii: a lone surrogate (valid JSON escape, not encodable UTF-8) reaches the engine as the
                # escape it came in as, and the engine answers 400 (regression: UnicodeEncodeError -> 500).
                content = json.dumps(body).encode()
                strip_usage = True
        headers = {"content-type": "application/json", constants.HEADER_REQUEST_ID: rid, "accept-encoding": "identity"}
        if self._auth is not None:
            headers["authorization"] = self._auth

        await _Relay(
            self, kind, path, model, key, workers, ranked, prompt_tokens, out_tokens, content, headers, strip_usage, t0
        ).run(receive, send)


def _content_type(scope: Scope) -> str | None:
    """The request's ``Content-Type`` header (latin-1, as ASGI carries it), or None."""
    headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
    for k, v in headers:
        if k.lower() == _H_CT:
            return v.decode("latin-1")
    return None


class _Endpoint:
    """ASGI app for one proxied route (a class instance, so Starlette mounts it as a raw ASGI app)."""

    def __init__(self, proxy: Proxy, kind: Kind, path: str) -> None:
        self.proxy, self.kind, self.path = proxy, kind, path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.proxy.handle(self.kind, self.path, scope, receive, send)


class _Relay:
    """One request's dispatch, retries and relay; counts the request in flight on its worker until it ends."""

    def __init__(
        self,
        proxy: Proxy,
        kind: Kind,
        path: str,
        model: str,
        key: PrefixKey | None,
        workers: list[WorkerState],
        ranked: list[RouteDecision],
        prompt_tokens: int,
        out_tokens: int,
        content: bytes,
        headers: dict[str, str],
        strip_usage: bool,
        t0: float,
    ) -> None:
        self.p = proxy
        self.kind, self.path, self.model, self.key = kind, path, model, key
        self.workers, self.ranked = workers, ranked
        self.prompt_tokens, self.out_tokens = prompt_tokens, out_tokens
        self.content, self.headers, self.strip_usage, self.t0 = content, headers, strip_usage, t0
        self.worker: WorkerState | None = None  # the worker the request is counted on
        self.tokens = 0
        self.resp: httpx.Response | None = None
        self.code = 499  # the status the client got (499, nginx's "client closed request": the client left)
        self.counted = False  # an error reply already counted the request
        self.started = False  # the response start was sent
        self.sse = False  # ...and it is an event stream
        self.task: asyncio.Task[Any] | None = None  # the task serving this request (set by run)
        self.left = False  # the client disconnected
        self.abandoned: str | None = None  # why the worker was given up on (a stall), set by ``abandon``
        self._chunks: AsyncIterator[bytes] | None = None  # the stream's body iterator once its first chunk is read

    def abandon(self, reason: str) -> None:
        """The worker this request waits on stalled (``WorkerPool.on_stall``): cancel the wait there; the request
        moves to the next candidate when it has sent the client nothing, else its stream ends with an error event."""
        if self.abandoned is None and self.task is not None and not self.task.done():
            self.abandoned = reason
            self.task.cancel()

    def _take_abandon(self) -> str | None:
        """After a CancelledError: the stall reason when ``abandon`` caused it (and not a client that left or a
        shutdown, which win), the cancellation then undone; else None (re-raise)."""
        reason, self.abandoned = self.abandoned, None
        if reason is None or self.left or self.p.shutting_down or self.task is None:
            return None
        self.task.uncancel()
        return reason

    async def run(self, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task

        async def watch_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.left = True
                    task.cancel()
                    return

        watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        self.p._active.add(task)
        try:
            await self._dispatch_and_relay(send)
        except asyncio.CancelledError:
            if self.left:
                task.uncancel()
                self.code = 499
            elif self.p.shutting_down:
                task.uncancel()
                await self._end_for_shutdown(send)
            else:
                raise
        finally:
            self.p._active.discard(task)
            watcher.cancel()
            await self._close()
            if not self.counted:
                self.p._count(self.model, self.code)
            self.p.metrics.duration.observe(time.perf_counter() - self.t0)

    async def _end_for_shutdown(self, send: Send) -> None:
        try:
            if not self.started:
                await self.p._error(send, 503, "the router is shutting down; retry", self.model)
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
            self.p._unwatch(self, self.worker)  # first: no stall cancels this request while it closes
        try:
            if resp is not None:
                await resp.aclose()  # unread body: httpx drops the connection, the engine sees the disconnect
        finally:
            if self.worker is not None:
                self.p.pool.release(self.worker, self.tokens)
                self.worker = None

    async def _dispatch_and_relay(self, send: Send) -> None:
        p = self.p
        by_url = {w.url: w for w in self.workers}
        # What any routable worker holds of this prompt, before this request's own dispatch is recorded.
        cacheable = cacheable_tokens(p.policy, self.key, by_url)
        attempts = min(len(self.ranked), 1 + p.args.max_retries)
        last_error = "no candidate"
        decision: RouteDecision | None = None
        reason = "fallback"
        first: bytes | None = None  # a stream's first chunk, read before the client gets any byte
        tried = 0
        answered = False
        for candidate in self.ranked:
            if tried == attempts:
                break
            w = by_url[candidate.worker]
            if tried > 0 and (w.removed or not w.breaker.routable):
                continue  # ejected or gone since the request was ranked: not worth an attempt
            decision = candidate
            reason = decision.reason if tried == 0 else "retry"
            if tried > 0:
                p.metrics.retries.inc()
            tried += 1
            self.tokens = max(0, self.prompt_tokens - decision.predicted_cached_tokens) + self.out_tokens
            self.worker = w
            p.pool.acquire(w, self.tokens)
            p._watch(self, w)
            if self.key is not None:
                # Recorded at dispatch, not at the answer: a burst sharing a cold prefix follows this request to
                # the engine that is prefilling it (a non-streaming answer starts only when it is done).
                p.policy.record(w.url, self.key)
            try:
                resp = await self._send(w)
                self.resp = resp
                if resp.status_code == 200 and resp.headers.get("content-type", "").startswith("text/event-stream"):
                    # The client gets the stream's headers with its first event: until then a stall or a drop moves
                    # the stream to the next engine, as for a request not answered yet.
                    first = await self._first_chunk(resp)
            except asyncio.CancelledError:
                why = self._take_abandon()
                if why is None:
                    raise
                last_error = f"{w.url}: stalled, {why}"
                await self._close()
                continue
            except _Dropped as e:
                last_error = f"{w.url}: {e}"
                p.pool.record_failure(w, f"{e} on POST {self.path}")
                await self._close()
                continue
            except httpx.TimeoutException as e:  # read/write/pool timeout: the request may be running; no retry
                p.pool.record_failure(w, f"{failure_reason(e)} on POST {self.path}")
                await self._close()
                await p._error(send, 504, f"the engine {w.url} did not answer in time", self.model, worker=w.url)
                self.counted = True
                return
            except httpx.HTTPError as e:
                p.pool.record_failure(w, f"{failure_reason(e)} on POST {self.path}")
                await self._close()
                await p._error(send, 502, f"the engine {w.url} failed: {type(e).__name__}", self.model, worker=w.url)
                self.counted = True
                return
            if resp.status_code >= 500:
                p.pool.record_failure(w, status_reason(resp.status_code, "POST", self.path))
                if resp.status_code == 503 and tried < attempts:
                    last_error = f"{w.url}: answered 503"
                    await self._close()
                    continue
            elif resp.status_code == 404 and self.model in w.models:
                # The engine does not serve the model it listed: restarted with another one at the same URL. Re-read
                # its models now and try an engine still serving it; the last candidate's 404 goes to the client.
                p.pool.reprobe(w)
                if tried < attempts:
                    last_error = f"{w.url}: does not serve {self.model} any more"
                    await self._close()
                    continue
            else:
                p.pool.record_success(w)
            answered = True
            break
        if not answered:
            await p._error(send, 503, f"no engine could take the request (last error: {last_error})", self.model)
            self.counted = True
            return

        assert decision is not None and self.resp is not None
        resp = self.resp
        if resp.status_code < 400:
            p._decision_children[reason].inc()
            if decision.predicted_cached_tokens:
                p.metrics.predicted_cached.inc(decision.predicted_cached_tokens)
            if cacheable:
                p.metrics.cacheable.inc(cacheable)
        await self._relay(send, resp, decision.worker, reason, first)

    async def _first_chunk(self, resp: httpx.Response) -> bytes:
        """A stream's first chunk (b"" for an empty stream); ``_relay_sse`` goes on with the same iterator. A
        connection dropped before it is ``_Dropped`` (retried); a read timeout raises as in ``_send``."""
        self._chunks = chunks = resp.aiter_raw()
        try:
            return await chunks.__anext__()
        except StopAsyncIteration:
            return b""
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            raise _Dropped(f"{failure_reason(e)} before the first event") from e

    async def _send(self, w: WorkerState) -> httpx.Response:
        p = self.p
        url = p._urls.get((w.url, self.path))
        if url is None:
            url = p._urls[(w.url, self.path)] = httpx.URL(w.url + self.path)
        request = httpx.Request("POST", url, content=self.content, headers=self.headers, extensions=p._extensions)
        try:
            # Straight to the pooled transport: AsyncClient.send adds cookies, auth, redirects and event hooks that
            # a proxy does not use (about a fifth of the router's CPU per request, measured).
            return await p.transport.handle_async_request(request)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise _Dropped(failure_reason(e)) from e
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            # The connection closed or reset before any response byte: the engine died (a pooled connection to a
            # killed engine reads a reset), or it closed a keep-alive connection just as we reused it. Nothing was
            # answered, so the next candidate may serve it.
            raise _Dropped(failure_reason(e)) from e

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
                    cached = sum(int(m) for m in _CACHED_RE.findall(b"".join(parts)))
                    if cached:
                        self.p.metrics.actual_cached.inc(cached)
        except httpx.HTTPError as e:  # the engine died or stalled mid-response: end the stream with an error event
            if self.worker is not None:
                self.p.pool.record_failure(self.worker, f"{failure_reason(e)} mid-response on POST {self.path}")
            logger.warning("engine %s failed mid-response: %s", worker, type(e).__name__)
            if sse:
                await send(
                    {
                        "type": "http.response.body",
                        "more_body": True,
                        "body": sse_error(f"the engine {worker} failed mid-response", 502) + SSE_DONE,
                    }
                )
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
                await send(
                    {
                        "type": "http.response.body",
                        "more_body": True,
                        "body": sse_error(f"the engine {worker} stopped responding mid-response", 504) + SSE_DONE,
                    }
                )
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _relay_sse(self, send: Send, resp: httpx.Response, ok: bool, first_chunk: bytes | None) -> None:
        metrics = self.p.metrics
        strip = self.strip_usage
        native = self.kind == "generate"
        cached: dict[bytes, int] = {}  # sample/prompt index -> cached prompt tokens
        buf = b""
        first = True
        chunks = self._chunks if self._chunks is not None else resp.aiter_raw()
        pending = first_chunk or None  # read by _first_chunk before the response start
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
                metrics.ttft.observe(time.perf_counter() - self.t0)
            if not strip:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if not ok:
                continue
            buf += chunk
            end = buf.rfind(b"\n\n")
            if end < 0:
                continue
            complete, buf = buf[: end + 2], buf[end + 2 :]
            if strip:
                complete = self._strip_usage_events(complete, cached)
                if complete:
                    await send({"type": "http.response.body", "body": complete, "more_body": True})
            elif b'"cached_tokens"' in complete:
                for event in complete.split(b"\n\n"):
                    m = _CACHED_RE.search(event)
                    if m is not None:
                        idx = _INDEX_RE.search(event) if native else None
                        cached[idx.group(1) if idx is not None else b""] = int(m.group(1))
        if strip and buf:
            await send({"type": "http.response.body", "body": buf, "more_body": True})
        total = sum(cached.values())
        if total:
            metrics.actual_cached.inc(total)

    @staticmethod
    def _strip_usage_events(complete: bytes, cached: dict[bytes, int]) -> bytes:
        """Drop the usage-only event (``choices: []`` with ``usage``) from complete SSE events, noting its
        cached tokens; everything else is kept byte for byte."""
        # The engine adds "usage":null as the last key of every chunk once usage is asked for; drop it so the client
        # gets the same bytes as without include_usage.
        complete = complete.replace(b',"usage":null}\n\n', b"}\n\n")
        if b'"usage"' not in complete:
            return complete
        kept = []
        for event in complete.split(b"\n\n")[:-1]:
            if b'"usage"' not in event or not event.startswith(b"data: "):
                kept.append(event)
                continue
            # Not our engine's compact form (another server, or spaces): decide on the parsed chunk.
            try:
                chunk = json.loads(event[6:])
            except ValueError:
                kept.append(event)
                continue
            if not isinstance(chunk, dict) or "usage" not in chunk:
                kept.append(event)
                continue
            usage = chunk.get("usage")
            if isinstance(usage, dict) and chunk.get("choices") == []:
                details = usage.get("prompt_tokens_details") or {}
                c = details.get("cached_tokens") if isinstance(details, dict) else None
                if isinstance(c, int):
                    cached[b""] = c
                continue  # the usage-only chunk the client did not ask for
            if usage is None:
                del chunk["usage"]
                event = b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()
            kept.append(event)
        return b"".join(e + b"\n\n" for e in kept)
