"""The one request pipeline every generating endpoint runs (after SGLang's ``entrypoints/openai/serving_base.py``).

``Serving.handle``: ``build`` (validate, tokenize, turn the body into ``GenerateRequest`` s: a ``Job``) → submit them
as one output group and wait for every request's first output (so 429 / 503 / grammar 400s are HTTP errors even for
``stream: true``) → either collect every output into the job's results and answer ``final`` as JSON, or stream
``stream_head``, one ``stream_delta`` per output (after ``stream_result_head`` before a result's first) and
``stream_tail`` as SSE events, then ``data: [DONE]``. An error
after the stream started is one SSE error event (the contracts' error body) and ``[DONE]``. A client that leaves
cancels the group, which aborts the engine requests. Endpoints (``serving_chat.py``, ``serving_completions.py``,
``serving_native.py``) only build requests and format results.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import anyio
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from radixserve.contracts.sse import SSE_DONE, sse, sse_error
from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, ReqOutput, TokenLogprob
from radixserve.engine.server.client_io import SSEResponse, cancel_on_disconnect
from radixserve.engine.server.common import abort_error, is_abort
from radixserve.engine.server.context import ServerContext
from radixserve.engine.server.generation import GenerationGroup, OutputGroup

logger = logging.getLogger("radixserve.engine.server")


@dataclass
class SampleState:
    """What has been generated so far for one result: one sample (``index``) of one engine request.

    Endpoints subclass it to keep their own per-result state (a chat choice's output parser, a completion's text
    offsets); ``add`` is called once per ``ReqOutput`` delta, in order.
    """

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # The prompt's logprobs from the request's logprob_start_len on (position 0's entry None), once they arrive.
    input_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    deltas: int = 0  # ReqOutputs added so far

    def add(self, out: ReqOutput) -> None:
        """Append one delta of this sample."""
        self.deltas += 1
        self.text_parts.append(out.text)
        self.token_ids.extend(out.token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.input_token_logprobs is not None:
            self.input_logprobs = out.input_token_logprobs
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


ResultT = TypeVar("ResultT", bound=SampleState)


@dataclass(kw_only=True)
class Job(Generic[ResultT]):
    """One HTTP request turned into engine requests, and its results as they arrive.

    ``reqs``: the engine requests (one per prompt). ``results``: one per sample, prompt-major (request 0's ``n``
    samples, then request 1's, ...). ``rids``: the engine request ids claimed in ``ctx.rids``, released when the
    response ends. A job serves one response, so its results are filled once (collected or streamed).
    """

    reqs: list[GenerateRequest]
    results: list[ResultT]
    rids: list[str]
    stream: bool
    _first: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._first = [0]
        for req in self.reqs:
            self._first.append(self._first[-1] + req.sampling_params.n)
        if self._first[-1] != len(self.results):  # pragma: no cover - an endpoint's bug
            raise ValueError(f"{len(self.results)} results for {self._first[-1]} samples")

    def result_index(self, pos: int, index: int) -> int:
        """The result of sample ``index`` of request ``pos``."""
        return self._first[pos] + index


BodyT = TypeVar("BodyT", bound=BaseModel)
JobT = TypeVar("JobT", bound=Job[Any])


class Serving(ABC, Generic[BodyT, JobT]):
    """A generating endpoint: ``build`` its job from a request body, format its results; ``handle`` runs the rest.

    ``aborts_are_errors``: an engine abort (``finish_reason.type == "abort"``) is answered as an error (its status,
    503 by default) instead of a result: OpenAI's endpoints, which have no abort finish reason.
    """

    aborts_are_errors: ClassVar[bool] = True

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    # ------------------------------------------------------------------------------------------ what endpoints write

    @abstractmethod
    async def build(self, request: Request, body: BodyT) -> JobT:
        """Validate ``body``, tokenize its prompts (off the event loop) and build the job; claims its rids last.

        Raises ``InvalidRequestError`` (the contracts' error body and status) for anything wrong with the request.
        """

    @abstractmethod
    def prompt_token_ids(self, body: BodyT) -> list[list[int]]:
        """The token ids of each prompt ``body`` would prefill, rendered and tokenized as ``build`` does (blocking:
        run in a worker thread). Raises ``InvalidRequestError`` as ``build`` would."""

    @abstractmethod
    def final(self, job: JobT) -> Any:
        """The JSON body of a complete (non-streamed) answer, once every result has finished."""

    def stream_head(self, job: JobT) -> Iterable[dict[str, Any]]:
        """SSE events before any output (chat's role chunks, an echoed prompt)."""
        return ()

    def stream_result_head(self, job: JobT, r: int) -> Iterable[dict[str, Any]]:
        """SSE events before result ``r``'s first delta, once it has been added (a completion's echoed prompt, with
        the prompt logprobs that delta brought)."""
        return ()

    @abstractmethod
    def stream_delta(self, job: JobT, r: int, out: ReqOutput) -> dict[str, Any] | None:
        """The SSE event for ``out``, a delta of result ``r`` (already added to ``job.results[r]``); None: nothing
        to send."""

    def stream_tail(self, job: JobT) -> Iterable[dict[str, Any]]:
        """SSE events after the last output (a usage chunk), before ``[DONE]``."""
        return ()

    def output_group(self, job: JobT) -> OutputGroup:
        """The group that runs ``job.reqs`` (wrapped by endpoints that check more before the response starts)."""
        return GenerationGroup(self.ctx.engine, job.reqs)

    # ------------------------------------------------------------------------------------------ the shared path

    async def handle(self, request: Request, body: BodyT) -> Response:
        """Answer ``body``: JSON, or an SSE stream with ``stream: true``. Errors up to the first output of every
        request are HTTP errors (``InvalidRequestError``, ``ClientDisconnected``); later ones an SSE error event."""
        job = await self.build(request, body)
        group = self.output_group(job)
        if not job.stream:

            async def work() -> Response:
                try:
                    await group.start()
                    return JSONResponse(await self._collect(job, group))
                finally:
                    await group.aclose()

            try:
                return await cancel_on_disconnect(request, work())
            finally:
                self.ctx.rids.release(job.rids)
        try:
            await cancel_on_disconnect(request, group.start())
        except BaseException:
            await group.aclose()
            self.ctx.rids.release(job.rids)
            raise
        return SSEResponse(self._stream(job, group))

    def _add(self, job: JobT, pos: int, out: ReqOutput) -> int:
        r = job.result_index(pos, out.index)
        job.results[r].add(out)
        return r

    async def _collect(self, job: JobT, group: OutputGroup) -> Any:
        async for pos, out in group:
            self._add(job, pos, out)
        if self.aborts_are_errors:
            for st in job.results:
                if is_abort(st.finish_reason):
                    raise abort_error(st.finish_reason)
        return self.final(job)

    async def _stream(self, job: JobT, group: OutputGroup) -> AsyncIterator[bytes]:
        try:
            for event in self.stream_head(job):
                yield sse(event)
            async for pos, out in group:
                r = self._add(job, pos, out)
                if self.aborts_are_errors and is_abort(out.finish_reason):
                    raise abort_error(out.finish_reason)
                if job.results[r].deltas == 1:
                    for event in self.stream_result_head(job, r):
                        yield sse(event)
                delta = self.stream_delta(job, r, out)
                if delta is not None:
                    yield sse(delta)
            for event in self.stream_tail(job):
                yield sse(event)
            yield SSE_DONE
        except InvalidRequestError as e:
            yield sse_error(e.message, e.status_code, e.param)
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001 - the response has started; report in-band
            logger.exception("error while streaming %s", job.rids)
            yield sse_error(f"internal error: {type(e).__name__}", 500)
            yield SSE_DONE
        finally:
            with anyio.CancelScope(shield=True):
                await group.aclose()
            self.ctx.rids.release(job.rids)
