"""Running tokenized requests on the engine from the HTTP layer: fan-in of several generations, client disconnects.

``GenerationGroup`` drives one ``Engine.generate`` iterator per prompt (a batch of prompts is several requests; the
``n`` samples of one prompt are one request) in its own asyncio task and merges their ``ReqOutput`` deltas in arrival
order (a request with ``max_new_tokens == 0`` is answered without the engine). ``start()`` waits for every
request's first delta, so a full queue (429) or a shutting-down engine (503) is known before the HTTP response
starts. Closing the group cancels the tasks, which closes the engine iterators; the engine then aborts the requests
and frees their KV cache (SGLang's ``abort_request`` on disconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response

from radixserve.contracts.sse import SSE_DONE, sse_error
from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, ReqOutput
from radixserve.engine.server.common import SSEResponse

if TYPE_CHECKING:  # pragma: no cover
    from radixserve.engine.engine import Engine
    from radixserve.engine.server.common import ServerContext

logger = logging.getLogger("radixserve.engine.server")

T = TypeVar("T")

_END = object()


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


class OutputGroup(Protocol):
    """What ``respond`` drives: a ``GenerationGroup`` or a wrapper of one (openai_api's ``PreflightGroup``,
    ``ToolGrammarGroup``)."""

    async def start(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[tuple[int, ReqOutput]]: ...

    async def aclose(self) -> None: ...


GroupT = TypeVar("GroupT", bound=OutputGroup)


class GenerationGroup:
    """Concurrent generations of several ``GenerateRequest`` s, merged into one stream of ``(position, ReqOutput)``.

    ``position`` is the request's index in ``reqs``. Use as::

        group = GenerationGroup(engine, reqs)
        try:
            await group.start()            # raises InvalidRequestError (e.g. 429, 503) before any output
            async for pos, out in group:
                ...
        finally:
            await group.aclose()           # aborts whatever is still running
    """

    def __init__(self, engine: Engine, reqs: list[GenerateRequest]):
        self.engine = engine
        self.reqs = reqs
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._first: list[asyncio.Future[None]] = []
        self._open = len(reqs)
        self._closed = False

    async def _nothing_to_generate(self, req: GenerateRequest) -> AsyncGenerator[ReqOutput, None]:
        """``max_new_tokens == 0``: answered here (finish "length", no tokens) without a forward pass."""
        if not self.engine.is_healthy():
            raise InvalidRequestError("the engine is not ready", None, status_code=503)
        key = req.sampling_params.grammar_key()
        backend = getattr(self.engine, "grammar_backend", None)
        if key is not None and backend is not None:
            await backend.get(*key)  # an invalid grammar is a 400 even when nothing would be generated
        for i in range(req.sampling_params.n):
            yield ReqOutput(
                rid=req.rid,
                index=i,
                text="",
                token_ids=[],
                logprobs=[] if req.return_logprob else None,
                finish_reason={"type": "length", "matched": None},
                prompt_tokens=len(req.input_ids),
                completion_tokens=0,
                cached_tokens=0,
            )

    async def _pump(self, pos: int, first: asyncio.Future[None]) -> None:
        req = self.reqs[pos]
        agen = self._nothing_to_generate(req) if req.sampling_params.max_new_tokens == 0 else self.engine.generate(req)
        try:
            async for out in agen:
                if not first.done():
                    first.set_result(None)
                self._queue.put_nowait((pos, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, or re-raised on cancellation
            if not first.done():
                first.set_exception(e if isinstance(e, Exception) else ClientDisconnected())
            if isinstance(e, asyncio.CancelledError):
                raise
            self._queue.put_nowait((pos, e))
        finally:
            if not first.done():
                first.set_exception(RuntimeError("the engine produced no output"))
            self._queue.put_nowait((pos, _END))
            await agen.aclose()  # no-op when finished; aborts the request otherwise

    async def start(self) -> None:
        """Submit every request and wait for each one's first output.

        Raises ``InvalidRequestError`` (or another exception from the engine) if any request fails to start; then
        all the group's requests are aborted.
        """
        loop = asyncio.get_running_loop()
        for pos in range(len(self.reqs)):
            fut: asyncio.Future[None] = loop.create_future()
            self._first.append(fut)
            self._tasks.append(asyncio.ensure_future(self._pump(pos, fut)))
        await asyncio.wait(self._first)
        for fut in self._first:
            if fut.exception() is not None:
                await self.aclose()
                raise fut.exception()  # type: ignore[misc]

    async def __aiter__(self) -> AsyncIterator[tuple[int, ReqOutput]]:
        while self._open > 0:
            pos, item = await self._queue.get()
            if item is _END:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield pos, item

    async def aclose(self) -> None:
        """Cancel the requests still running (the engine aborts them and frees their KV) and wait for that."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            if not t.done():
                t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        for fut in self._first:  # silence "exception never retrieved"
            if fut.done() and not fut.cancelled():
                fut.exception()


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (reads ASGI messages after the body until ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` (a non-streaming request) and cancel it if the client disconnects first.

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


def status_of(exc: BaseException) -> int:
    """HTTP status for an exception raised while starting a generation."""
    if isinstance(exc, InvalidRequestError):
        return exc.status_code
    return 500


async def respond(
    ctx: ServerContext,
    request: Request,
    group: GroupT,
    rids: list[str],
    stream: bool,
    collect: Callable[[GroupT], Awaitable[Response]],
    chunks: Callable[[GroupT], AsyncIterator[bytes]],
) -> Response:
    """Run ``group`` and answer with ``collect`` (non-streaming) or an SSE stream of ``chunks``.

    Errors up to the first output of every request are HTTP errors; later ones become an SSE error event.
    """
    if not stream:

        async def work() -> Response:
            try:
                await group.start()
                return await collect(group)
            finally:
                await group.aclose()

        try:
            return await cancel_on_disconnect(request, work())
        finally:
            ctx.rids.release(rids)

    try:
        await cancel_on_disconnect(request, group.start())
    except BaseException:
        await group.aclose()
        ctx.rids.release(rids)
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks(group):
                yield chunk
        except InvalidRequestError as e:
            yield sse_error(e.message, e.status_code, e.param)
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001 - the response has started; report in-band
            logger.exception("error while streaming %s", rids)
            yield sse_error(f"internal error: {type(e).__name__}", status_of(e))
            yield SSE_DONE
        finally:
            with anyio.CancelScope(shield=True):
                await group.aclose()
            ctx.rids.release(rids)

    return SSEResponse(body())
