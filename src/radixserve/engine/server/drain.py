"""The engine's graceful drain (docs/contracts.md, "Graceful drain"): what the first SIGTERM / Ctrl-C starts.

``Drain`` holds the state: ``draining`` (readiness fails, generation requests are no longer admitted) and the
generation requests admitted and not yet answered. ``DrainMiddleware`` (pure ASGI, so streams pass through) counts
each ``POST`` of ``GENERATION_PATHS`` from admission until its response has been sent, and answers the new ones
with ``Drain.refusal()`` once draining. ``Drain.run`` waits for those in flight, at most ``--shutdown-timeout``
seconds, then aborts the rest (the engine's shutdown: a 503, or an SSE error event and ``[DONE]``); the wait is
``contracts/drain.py``'s, shared with the router. Everything runs on the server's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.contracts import constants
from radixserve.contracts.drain import IdleSignal, drain_in_flight
from radixserve.contracts.edge import error_response

logger = logging.getLogger("radixserve.engine.server")

# The generation routes: those a draining engine no longer admits and whose requests in flight it waits for.
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
DRAINING_MESSAGE = "the engine is shutting down and takes no new requests; retry"
# With error_response's "Retry-After: 1" (every 503): alive and finishing its requests, not failing.
_DRAINING_HEADERS = {constants.HEADER_DRAINING: "1"}


class Drain:
    """The drain state of one engine server: ``draining`` turns true with ``run`` and stays so."""

    def __init__(self) -> None:
        self.draining = False
        self._inflight = 0
        self._idle = IdleSignal()

    def __len__(self) -> int:
        """Generation requests admitted and not yet answered."""
        return self._inflight

    def refusal(self) -> JSONResponse:
        """The draining engine's 503 (OpenAI error body, ``Retry-After: 1``, ``x-radixserve-draining: 1``), for
        ``/health`` and every generation request that comes once the drain has begun."""
        return error_response(DRAINING_MESSAGE, 503, headers=_DRAINING_HEADERS)

    def enter(self) -> None:
        """A generation request was admitted (until ``leave``)."""
        self._inflight += 1
        self._idle.busy()

    def leave(self) -> None:
        """A request counted by ``enter`` has been answered (or its client left)."""
        self._inflight -= 1
        if not self._inflight:
            self._idle.idle()

    async def run(self, timeout_s: float, abort: Callable[[], None]) -> None:
        """Drain (once, on the event loop): from now on ``/health`` and new generation requests get ``refusal()``;
        the requests in flight, streams included, go on for up to ``timeout_s`` seconds (``--shutdown-timeout``);
        then ``abort()`` (must not block: the engine's shutdown in a thread) ends what is left with the error it
        gets today. Cancelled (a second signal), it calls ``abort()`` at once. Returns when no request is left in
        flight or ``abort()`` has been called; ``abort()`` is called in every case (it stops the engine)."""
        self.draining = True
        await drain_in_flight(self.__len__, self._idle, timeout_s, abort, logger)


class DrainMiddleware:
    """Pure-ASGI gate of ``GENERATION_PATHS``: while ``drain.draining`` a ``POST`` there is answered
    ``drain.refusal()``; otherwise it is counted in flight (``Drain.enter`` / ``leave``) for as long as the app
    serves it, streamed body included."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await self.drain.refusal()(scope, receive, send)
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()
