"""An engine that drains as docs/contracts.md ("Graceful drain") says the engine does on SIGTERM, for router and rollout
tests while the engine's own drain is not built: ``DrainingEngineApp`` wraps the real engine HTTP app (over a
``FakeEngine``) and, after ``begin_drain()``, answers ``GET /health`` and every new ``POST`` with an OpenAI-format 503
carrying ``Retry-After: 1`` and ``x-radixserve-draining: 1``, while the requests it had already admitted (streams
included) run to their end. ``inflight`` counts the POSTs under way, ``served`` the POSTs it admitted, ``refused``
the POSTs it answered with that 503."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.contracts import constants
from radixserve.contracts.protocol import error_body

DRAINING_HEADERS = [
    (b"content-type", b"application/json"),
    (b"retry-after", b"1"),
    (constants.HEADER_DRAINING.encode(), b"1"),
]


class DrainingEngineApp:
    """ASGI wrapper of an engine app with the engine's drain contract (module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.draining = False
        self.inflight = 0
        self.served = 0
        self.refused = 0

    def begin_drain(self) -> None:
        """SIGTERM, as the engine takes it: readiness fails and admission stops at once; admitted requests go on."""
        self.draining = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refuse = scope["path"] == constants.ENGINE_HEALTH_PATH or scope["method"] == "POST"
        if self.draining and refuse:
            self.refused += scope["method"] == "POST"
            body = json.dumps(error_body("the engine is draining (shutting down); retry", 503)).encode()
            await send({"type": "http.response.start", "status": 503, "headers": DRAINING_HEADERS})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        self.inflight += 1
        self.served += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1
