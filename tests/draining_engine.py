"""An engine app whose graceful drain (docs/contracts.md, "Graceful drain") a router or rollout test starts by hand:
``DrainingEngineApp`` wraps the real engine HTTP app (over a ``FakeEngine``) and ``begin_drain()`` turns on that app's
own ``Drain`` (engine/server/drain.py) as SIGTERM does: ``GET /health`` and every new generation ``POST`` answer a
503 with ``Retry-After: 1`` and ``x-radixserve-draining: 1``, while the requests already admitted (streams included)
run to their end. ``inflight`` counts the generation POSTs under way, ``served`` the POSTs answered otherwise than
with that 503, ``refused`` those answered with it."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.contracts import constants
from radixserve.engine.server.drain import Drain

_DRAINING_HEADER = constants.HEADER_DRAINING.encode()


class DrainingEngineApp:
    """ASGI wrapper of an engine app (``create_app``) counting its POSTs (module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.drain: Drain = app.state.drain  # type: ignore[attr-defined]
        self.served = 0
        self.refused = 0

    @property
    def inflight(self) -> int:
        """Generation requests the engine admitted and has not answered yet."""
        return len(self.drain)

    def begin_drain(self) -> None:
        """SIGTERM, as the engine takes it (``Drain.run``'s first step): readiness fails and admission stops at
        once; admitted requests go on. The abort past ``--shutdown-timeout`` is tested on engine processes
        (tests/test_engine_drain.py)."""
        self.drain.draining = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                refused = message["status"] == 503 and (_DRAINING_HEADER, b"1") in list(message.get("headers", []))
                if refused:
                    self.refused += 1
                else:
                    self.served += 1
            await send(message)

        await self.app(scope, receive, counted)
