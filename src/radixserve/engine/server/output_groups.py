"""Output groups that check more before an OpenAI response starts, wrapping a ``GenerationGroup``.

``PreflightGroup`` (``--stream-error-preflight``) makes an engine abort on a stream's first output an HTTP error;
``ToolGrammarGroup`` names the tool whose ``parameters`` a forced tool call's grammar could not compile.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, ReqOutput
from radixserve.engine.server.common import abort_error, is_abort
from radixserve.engine.server.engine_client import EngineClient
from radixserve.engine.server.generation import GenerationGroup, OutputGroup


def openai_group(engine: EngineClient, reqs: list[GenerateRequest], stream: bool) -> OutputGroup:
    """The group of an OpenAI request's ``reqs``: a ``PreflightGroup`` for a stream with
    ``--stream-error-preflight``, else a plain ``GenerationGroup``."""
    group = GenerationGroup(engine, reqs)
    return PreflightGroup(group) if stream and engine.args.stream_error_preflight else group


class PreflightGroup:
    """``--stream-error-preflight``: a ``GenerationGroup`` whose ``start()`` also reads each request's first output
    and raises its abort as an HTTP error (before the SSE response starts); the outputs read are replayed."""

    def __init__(self, group: GenerationGroup):
        self.group = group
        self.head: list[tuple[int, ReqOutput]] = []
        self._it: AsyncIterator[tuple[int, ReqOutput]] | None = None

    async def start(self) -> None:
        """Start the group, then read every request's first output. Raises ``InvalidRequestError`` for a failed
        start or an abort among those outputs (its status, 503 by default)."""
        await self.group.start()
        it = self._it = self.group.__aiter__()
        seen: set[int] = set()
        while len(seen) < len(self.group.reqs):  # every first output is already queued: this does not wait on decoding
            try:
                pos, out = await it.__anext__()
            except StopAsyncIteration:
                break
            self.head.append((pos, out))
            seen.add(pos)
            if is_abort(out.finish_reason):
                raise abort_error(out.finish_reason)

    async def __aiter__(self) -> AsyncIterator[tuple[int, ReqOutput]]:
        for item in self.head:
            yield item
        self.head = []
        assert self._it is not None, "start() first"
        async for item in self._it:
            yield item

    async def aclose(self) -> None:
        await self.group.aclose()


class ToolGrammarGroup:
    """A forced tool call's group: a grammar compile error of the call schema (the engine's 400 naming
    ``json_schema``, a field the client did not send) is re-raised naming ``tools[i].function.parameters``.

    ``tool_params``: ``[(param, that tool's call schema as JSON text)]`` of the tools the call may use; with several
    (``"required"``), the one that fails to compile alone is named (compiled through the engine, whose grammar cache
    holds the result), or ``tools`` when none can be singled out."""

    def __init__(self, group: OutputGroup, engine: EngineClient, tool_params: list[tuple[str, str]]):
        self.group, self.engine, self.tool_params = group, engine, tool_params

    async def _culprit(self) -> str:
        if len(self.tool_params) == 1:
            return self.tool_params[0][0]
        for param, text in self.tool_params:
            try:
                await self.engine.check_grammar("json_schema", text)
            except InvalidRequestError:
                return param
        return "tools"

    async def start(self) -> None:
        """Start the group. Raises ``InvalidRequestError``: the group's, or a 400 naming the tool at fault."""
        try:
            await self.group.start()
        except InvalidRequestError as e:
            if e.status_code != 400 or e.param != "json_schema":
                raise
            param = await self._culprit()
            message = e.message.removeprefix("invalid json_schema: ")
            raise InvalidRequestError(
                f"{param} cannot be used for a forced tool call (tool_choice): {message}", param
            ) from None

    def __aiter__(self) -> AsyncIterator[tuple[int, ReqOutput]]:
        return self.group.__aiter__()

    async def aclose(self) -> None:
        await self.group.aclose()
