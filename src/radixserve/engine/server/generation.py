"""Running tokenized requests on the engine from the HTTP layer: fan-in of several generations, client disconnects.

``GenerationGroup`` drives one ``Engine.generate`` iterator per prompt (a batch of prompts is several requests; the
``n`` samples of one prompt are one request) in its own asyncio task and merges their ``ReqOutput`` deltas in arrival
order (a request with ``max_new_tokens == 0`` and no prompt logprobs is answered without the engine). ``start()``
waits for every request's first delta, so a full queue (429) or a shutting-down engine (503) is known before the HTTP
response starts. Closing the group cancels the tasks, which closes the engine iterators; the engine then aborts the
requests and frees their KV cache (SGLang's ``abort_request`` on disconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, ReqOutput
from radixserve.engine.server.client_io import ClientDisconnected
from radixserve.engine.server.engine_client import EngineClient

_END = object()


class OutputGroup(Protocol):
    """What ``Serving.handle`` drives: a ``GenerationGroup`` or a wrapper of one (``output_groups.py``
    ``PreflightGroup``, ``ToolGrammarGroup``)."""

    async def start(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[tuple[int, ReqOutput]]: ...

    async def aclose(self) -> None: ...


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

    def __init__(self, engine: EngineClient, reqs: list[GenerateRequest]):
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
        if key is not None:
            await self.engine.check_grammar(*key)  # an invalid grammar is a 400 even when nothing would be generated
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
        # Nothing to generate and no prompt to score: answered here. Prompt logprobs need the engine's prefill.
        idle = req.sampling_params.max_new_tokens == 0 and req.logprob_start_len is None
        agen = self._nothing_to_generate(req) if idle else self.engine.generate(req)
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
