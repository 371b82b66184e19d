"""The HTTP client's side of a generation: noticing that it left, and an SSE response that always cleans up."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete (answered 499, which nobody reads)."""


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (reads ASGI messages after the body until ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` and cancel it if the client disconnects first.

    Raises ``ClientDisconnected`` after ``work`` was cancelled (its ``finally`` blocks aborted the generation).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientDisconnected()


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response that always closes its body iterator, so an abandoned stream aborts the engine
    request even when the client vanished between two chunks."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
