"""``POST /v1/chat/completions``: messages → chat template → one ``GenerateRequest`` (its ``n`` samples are the
choices); outputs → reasoning, content and tool calls (``tools.py``, ``reasoning.py``), as one response or as
``chat.completion.chunk`` events (after SGLang's ``entrypoints/openai/serving_chat.py``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from radixserve.contracts.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    DeltaMessage,
    FunctionCall,
    ToolCall,
    ToolCallDelta,
    Usage,
    now,
)
from radixserve.engine.io_struct import GenerateRequest, ReqOutput
from radixserve.engine.server.chat import RenderOptions, render_prompt
from radixserve.engine.server.common import (
    chat_id,
    encode_text,
    openai_finish_reason,
    request_id_of,
    resolve_max_tokens,
)
from radixserve.engine.server.generation import OutputGroup
from radixserve.engine.server.logprob_format import chat_logprobs
from radixserve.engine.server.openai_params import check_chat
from radixserve.engine.server.openai_sampling import sampling_params
from radixserve.engine.server.output_groups import ToolGrammarGroup, openai_group
from radixserve.engine.server.reasoning import make_reasoning_stream
from radixserve.engine.server.serving_base import Job, SampleState, Serving
from radixserve.engine.server.tool_parser import ChatOutputParser, ChoiceDelta
from radixserve.engine.server.tools import ToolChoice, call_schema, new_call_id, resolve_tool_choice, validate_tools


@dataclass(kw_only=True)
class ChatChoice(SampleState):
    """One choice: its output parser, the reasoning / content / calls it released so far, and the latest delta's
    (``delta``, the last one including what ``finish`` released)."""

    parser: ChatOutputParser
    one_call: bool = False  # parallel_tool_calls false: only the first call of a reply is returned
    got: ChoiceDelta = field(default_factory=ChoiceDelta)
    delta: ChoiceDelta = field(default_factory=ChoiceDelta)
    finished: bool = False

    def add(self, out: ReqOutput) -> None:
        super().add(out)
        self.delta = d = self.parser.feed(out.text, len(out.token_ids))
        self._take(d)
        if out.finish_reason is not None:
            f = self.finish()
            self.delta = ChoiceDelta(d.reasoning + f.reasoning, d.content + f.content, f.calls)

    def finish(self) -> ChoiceDelta:
        """Release what the parser still holds (once; later calls release nothing)."""
        if self.finished:
            return ChoiceDelta()
        self.finished = True
        f = self.parser.finish()
        self._take(f)
        return f

    def _take(self, d: ChoiceDelta) -> None:
        if d.calls and self.one_call:
            d.calls = d.calls[:1]
        self.got.reasoning += d.reasoning
        self.got.content += d.content
        if d.calls:
            self.got.calls = d.calls


@dataclass(kw_only=True)
class ChatJob(Job[ChatChoice]):
    """A chat request: its prompt length, logprobs (``top_k`` alternatives), usage options and response id."""

    prompt_tokens: int
    logprobs: bool
    top_k: int
    include_usage: bool
    with_reasoning: bool
    tool_params: list[tuple[str, str]] | None  # a forced call's tools: (param, call schema JSON), ToolGrammarGroup
    cid: str
    created: int = field(default_factory=now)


class ChatServing(Serving[ChatCompletionRequest, ChatJob]):
    """``POST /v1/chat/completions`` over ``ctx.engine``."""

    def render_options(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], ToolChoice, RenderOptions]:
        """The request's function tools, its resolved ``tool_choice`` and how to render it (the tools it offers shown
        unless the choice is ``none``). Raises ``InvalidRequestError`` (400 naming the field) for bad tools or
        choice."""
        args = self.ctx.engine.args
        functions = validate_tools(req.tools)
        choice = resolve_tool_choice(functions, req.tool_choice, args.tool_choice_as_auto)
        opts = RenderOptions(
            functions=choice.offered(functions) if choice.mode != "none" else None,
            flatten_tool_content=args.flatten_tool_content,
            accept_bare_image_url=args.accept_bare_image_url,
        )
        return functions, choice, opts

    def _render(self, req: ChatCompletionRequest, opts: RenderOptions) -> list[int]:
        """Messages → chat template → token ids (the template adds the special tokens itself)."""
        tok = self.ctx.engine.tokenizer
        opts.caps = self.ctx.template_caps
        return encode_text(tok, render_prompt(tok, req, opts), "messages", add_special_tokens=False)

    def prompt_token_ids(self, body: ChatCompletionRequest) -> list[list[int]]:
        return [self._render(body, self.render_options(body)[2])]

    async def build(self, request: Request, body: ChatCompletionRequest) -> ChatJob:
        ctx, req = self.ctx, body
        args = ctx.engine.args
        k = check_chat(ctx, req)
        functions, choice, opts = self.render_options(req)
        offered = choice.offered(functions)  # allowed_tools: the only ones callable
        sp = sampling_params(ctx, req, call_schema(offered, choice) if choice.forced else None)
        if choice.forced:
            mode = "forced"
        elif choice.mode == "auto" and sp.grammar_key() is None:
            mode = "auto"
        else:
            mode = "text"  # no tools, or a response_format shapes the reply: it is content, not a call
        ids = await asyncio.to_thread(self._render, req, opts)  # off the event loop: may take seconds
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sp.max_new_tokens = resolve_max_tokens(
            requested, args.default_chat_max_tokens, len(ids), ctx.context_length, param, "messages"
        )
        names = {f["name"] for f in offered}
        choices = [
            ChatChoice(
                parser=ChatOutputParser(mode, names, make_reasoning_stream(args.reasoning_parser)),
                one_call=req.parallel_tool_calls is False,
            )
            for _ in range(req.n)
        ]
        rids = ctx.rids.claim(request_id_of(request.scope), 1)
        greq = GenerateRequest(
            rid=rids[0],
            input_ids=ids,
            sampling_params=sp,
            return_logprob=req.logprobs,
            top_logprobs_num=k,
            stream=req.stream,
            arrival_time=time.monotonic(),
        )
        tool_params = None
        if choice.forced:
            index = {f["name"]: i for i, f in enumerate(functions)}  # the param names the request's own list
            used = [f for f in offered if choice.mode == "required" or f["name"] == choice.name]
            tool_params = [
                (f"tools[{index[f['name']]}].function.parameters", json.dumps(call_schema([f], ToolChoice("required"))))
                for f in used
            ]
        return ChatJob(
            reqs=[greq],
            results=choices,
            rids=rids,
            stream=req.stream,
            prompt_tokens=len(ids),
            logprobs=req.logprobs,
            top_k=k,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            with_reasoning=args.reasoning_parser is not None,
            tool_params=tool_params,
            cid=chat_id(rids[0]),
        )

    def output_group(self, job: ChatJob) -> OutputGroup:
        group = openai_group(self.ctx.engine, job.reqs, job.stream)
        if job.tool_params is not None:
            group = ToolGrammarGroup(group, self.ctx.engine, job.tool_params)
        return group

    # ------------------------------------------------------------------------------------------------ results

    def _usage(self, job: ChatJob) -> Usage:
        choices = job.results
        return Usage.of(
            job.prompt_tokens,
            sum(c.completion_tokens for c in choices),
            max(c.cached_tokens for c in choices),
            sum(c.parser.reasoning_tokens for c in choices) if job.with_reasoning else None,
        )

    def final(self, job: ChatJob) -> Any:
        choices = []
        for i, st in enumerate(job.results):
            st.finish()
            g = st.got
            reasoning = st.parser.reasoning
            has_reasoning = reasoning is not None and reasoning.has_reasoning
            content: str | None = g.content
            if g.calls or has_reasoning:
                content = g.content.strip() or None
            calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=nm, arguments=a)) for nm, a in g.calls or []]
            choices.append(
                ChatCompletionChoice(
                    index=i,
                    message=ChatResponseMessage(
                        content=content,
                        reasoning_content=g.reasoning if has_reasoning else None,
                        tool_calls=calls or None,
                    ),
                    logprobs=chat_logprobs(self.ctx.texts, st.logprobs, job.top_k) if job.logprobs else None,
                    finish_reason="tool_calls" if calls else openai_finish_reason(st.finish_reason),
                )
            )
        model = self.ctx.model_name
        return ChatCompletionResponse(id=job.cid, model=model, choices=choices, usage=self._usage(job)).model_dump()

    def _chunk(
        self, job: ChatJob, choices: list[ChatCompletionStreamChoice], usage: Usage | None = None
    ) -> dict[str, Any]:
        model = self.ctx.model_name
        d = ChatCompletionChunk(id=job.cid, created=job.created, model=model, choices=choices, usage=usage).model_dump()
        if not job.include_usage:
            d.pop("usage")
        return d

    def stream_head(self, job: ChatJob) -> Iterable[dict[str, Any]]:
        for i in range(len(job.results)):
            role = DeltaMessage(role="assistant", content="")
            yield self._chunk(job, [ChatCompletionStreamChoice(index=i, delta=role)])

    def stream_delta(self, job: ChatJob, r: int, out: ReqOutput) -> dict[str, Any] | None:
        d = job.results[r].delta
        lps = chat_logprobs(self.ctx.texts, out.logprobs, job.top_k) if job.logprobs and out.logprobs else None
        if not (d.content or d.reasoning or d.calls) and lps is None and out.finish_reason is None:
            return None
        tool_deltas = [
            ToolCallDelta(index=j, id=new_call_id(), type="function", function={"name": nm, "arguments": a})
            for j, (nm, a) in enumerate(d.calls or [])
        ]
        delta = DeltaMessage(
            content=d.content or None, reasoning_content=d.reasoning or None, tool_calls=tool_deltas or None
        )
        fr = "tool_calls" if tool_deltas else openai_finish_reason(out.finish_reason)
        return self._chunk(job, [ChatCompletionStreamChoice(index=r, delta=delta, logprobs=lps, finish_reason=fr)])

    def stream_tail(self, job: ChatJob) -> Iterable[dict[str, Any]]:
        if job.include_usage:
            yield self._chunk(job, [], self._usage(job))
