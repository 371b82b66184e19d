"""OpenAI ``/v1/chat/completions`` and ``/v1/completions`` as a thin translation over the engine's generate.

After SGLang's ``srt/entrypoints/openai/serving_chat.py`` / ``serving_completions.py``: validate everything that can be
validated (model, unsupported features, sampling ranges, context length), tokenize, submit one ``GenerateRequest`` per
prompt (``n`` samples share it), wait for the first output (so 429/503 are HTTP errors even when streaming), then either
collect the whole answer or stream SSE chunks ending with ``data: [DONE]``.

Constraints: ``response_format`` ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` becomes the
engine's ``json_schema`` (the schema as JSON text), ``{"type": "json_object"}`` the schema ``{"type": "object"}``,
``{"type": "text"}`` nothing; SGLang's extra keys ``json_schema``, ``regex``, ``ebnf`` pass through; a forced
``tool_choice`` (``required`` or named) becomes the call's JSON schema (``engine/server/tools.py``). At most one of
them per request; the engine refuses invalid grammars with a 400 before any output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, TypeGuard

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from radixserve.contracts.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatLogprobTop,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    FunctionCall,
    ToolCall,
    ToolCallDelta,
    Usage,
    now,
)
from radixserve.contracts.sse import SSE_DONE, sse
from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, ReqOutput, SamplingParams, TokenLogprob
from radixserve.engine.server.chat import RenderOptions, render_prompt
from radixserve.engine.server.common import (
    SampleState,
    ServerContext,
    TextOffsets,
    abort_error,
    chat_id,
    completion_id,
    encode_text,
    openai_finish_reason,
    request_id_of,
    resolve_max_tokens,
)
from radixserve.engine.server.generation import GenerationGroup, OutputGroup, respond
from radixserve.engine.server.reasoning import make_reasoning_stream
from radixserve.engine.server.tools import (
    ChatOutputParser,
    ChoiceDelta,
    ToolChoice,
    call_schema,
    new_call_id,
    resolve_tool_choice,
    validate_tools,
)

logger = logging.getLogger("radixserve.engine.server")

_OpenAIRequest = ChatCompletionRequest | CompletionRequest


JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})  # response_format {"type": "json_object"}


def _is_abort(fr: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    return fr is not None and fr.get("type") == "abort"


def response_format_schema(fmt: Any) -> str | None:
    """The engine ``json_schema`` (JSON text) for an OpenAI ``response_format``; None for ``text`` or absent.

    Raises ``InvalidRequestError`` (400, naming the field) for a malformed ``response_format``.
    """
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("response_format must be an object", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequestError(
                'response_format.json_schema must be an object {"name", "schema", "strict"}',
                "response_format.json_schema",
            )
        schema = js.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format.json_schema.schema must be a JSON schema object", "response_format.json_schema.schema"
            )
        if js.get("name") is not None and not isinstance(js["name"], str):
            raise InvalidRequestError(
                "response_format.json_schema.name must be a string", "response_format.json_schema.name"
            )
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise InvalidRequestError(
                "response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict"
            )
        return json.dumps(schema)  # always enforced (strict or not): decoding is constrained to the schema
    raise InvalidRequestError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format.type"
    )


class PreflightGroup:
    """``--stream-error-preflight``: a ``GenerationGroup`` whose ``start()`` also reads each request's first output
    and raises its abort as an HTTP error (before the SSE response starts); the outputs read are replayed."""

    def __init__(self, group: GenerationGroup):
        self.group = group
        self.head: list[tuple[int, ReqOutput]] = []
        self._it: AsyncIterator[tuple[int, ReqOutput]] | None = None

    async def start(self) -> None:
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
            if _is_abort(out.finish_reason):
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
    (``"required"``), the one that fails to compile alone is named (compiled through the engine's grammar backend,
    whose cache holds the result), or ``tools`` when none can be singled out."""

    def __init__(self, group: OutputGroup, engine: Any, tool_params: list[tuple[str, str]]):
        self.group, self.engine, self.tool_params = group, engine, tool_params

    async def _culprit(self) -> str:
        if len(self.tool_params) == 1:
            return self.tool_params[0][0]
        backend = getattr(self.engine, "grammar_backend", None)
        if backend is not None:
            for param, text in self.tool_params:
                try:
                    await backend.get("json_schema", text)
                except InvalidRequestError:
                    return param
        return "tools"

    async def start(self) -> None:
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


class OpenAIServing:
    """Handlers of the OpenAI endpoints over one engine (``ctx.engine``)."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    # ------------------------------------------------------------------------------------------------ validation

    def _check_common(self, req: _OpenAIRequest) -> None:
        self.ctx.check_model(req.model)
        if req.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", "logit_bias")
        if req.stream_options is not None and not req.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")

    def _group(self, reqs: list[GenerateRequest], stream: bool) -> OutputGroup:
        group = GenerationGroup(self.ctx.engine, reqs)
        return PreflightGroup(group) if stream and self.ctx.engine.args.stream_error_preflight else group

    @staticmethod
    def _constraint(req: _OpenAIRequest, forced_call: dict[str, Any] | None = None) -> dict[str, str | None]:
        """The one constraint of a request as SamplingParams fields ``json_schema``/``regex``/``ebnf``.

        Raises ``InvalidRequestError`` (400) for a malformed one or more than one."""
        found: dict[str, tuple[str, str]] = {}
        if forced_call is not None:
            found["tool_choice"] = ("json_schema", json.dumps(forced_call))
        fmt = response_format_schema(req.response_format)
        if fmt is not None:
            found["response_format"] = ("json_schema", fmt)
        if req.json_schema is not None:
            if isinstance(req.json_schema, dict):
                found["json_schema"] = ("json_schema", json.dumps(req.json_schema))
            elif isinstance(req.json_schema, str):
                found["json_schema"] = ("json_schema", req.json_schema)
            else:
                raise InvalidRequestError("json_schema must be a JSON schema object or its JSON text", "json_schema")
        for kind in ("regex", "ebnf"):
            value = getattr(req, kind)
            if value is not None:
                if not isinstance(value, str):  # pragma: no cover - the model types it
                    raise InvalidRequestError(f"{kind} must be a string", kind)
                found[kind] = (kind, value)
        if len(found) > 1:
            names = list(found)
            raise InvalidRequestError(f"only one output constraint per request; got {' and '.join(names)}", names[1])
        out: dict[str, str | None] = {"json_schema": None, "regex": None, "ebnf": None}
        for kind, text in found.values():
            out[kind] = text
        return out

    def _sampling(self, req: _OpenAIRequest, forced_call: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams with OpenAI's defaults; ``max_new_tokens`` is set later, once the prompt length is known.

        ``forced_call``: the JSON schema of a forced tool call (the request's output constraint)."""
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        defaults = getattr(self.ctx.engine, "sampling_defaults", {})  # --preferred-sampling-params
        constraint = self._constraint(req, forced_call)
        sp = SamplingParams(
            max_new_tokens=None,
            temperature=defaults.get("temperature", 1.0) if req.temperature is None else req.temperature,
            top_p=defaults.get("top_p", 1.0) if req.top_p is None else req.top_p,
            top_k=defaults.get("top_k", -1) if req.top_k is None else req.top_k,
            min_p=defaults.get("min_p", 0.0) if req.min_p is None else req.min_p,
            presence_penalty=defaults.get("presence_penalty", 0.0)
            if req.presence_penalty is None
            else req.presence_penalty,
            frequency_penalty=defaults.get("frequency_penalty", 0.0)
            if req.frequency_penalty is None
            else req.frequency_penalty,
            repetition_penalty=defaults.get("repetition_penalty", 1.0)
            if req.repetition_penalty is None
            else req.repetition_penalty,
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            n=req.n,
            **constraint,
            no_stop_trim=req.no_stop_trim,
            skip_special_tokens=req.skip_special_tokens,
        )
        sp.validate(self.ctx.engine.vocab_size)
        return sp

    # ------------------------------------------------------------------------------------------------ logprobs

    def _chat_logprobs(self, lps: list[TokenLogprob], k: int) -> ChatLogprobs:
        texts = self.ctx.texts
        content = []
        for lp in lps:
            text, raw = texts.get(lp.token_id)
            top = [ChatLogprobTop(token=texts.get(t)[0], logprob=v, bytes=texts.get(t)[1]) for t, v in lp.top[:k]]
            content.append(ChatLogprobEntry(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=top))
        return ChatLogprobs(content=content)

    def _legacy_logprobs(
        self, lps: list[TokenLogprob], k: int, offsets: TextOffsets, prompt_ids: list[int] | None = None
    ) -> CompletionLogprobs:
        """Legacy logprobs for ``prompt_ids`` (echo; logprobs unknown → null) then ``lps``.

        ``offsets`` tracks where the next token starts in the choice's text (advanced here; kept across the chunks
        of a stream). ``top_logprobs`` holds the top ``k`` alternatives plus the sampled token (OpenAI: up to
        ``logprobs + 1``); tokens that are not whole UTF-8 characters are shown as ``bytes:\\xNN...``.
        """
        texts = self.ctx.texts
        out = CompletionLogprobs()
        for t in prompt_ids or []:
            out.tokens.append(texts.legacy(t))
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offsets.advance(t, in_prompt=True))
        for lp in lps:
            text = texts.legacy(lp.token_id)
            top: dict[str, float] = {}
            for t, v in lp.top[:k]:
                top.setdefault(texts.legacy(t), v)
            top.setdefault(text, lp.logprob)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append(top)
            out.text_offset.append(offsets.advance(lp.token_id))
        return out

    # ------------------------------------------------------------------------------------------------ chat

    async def chat(self, request: Request, req: ChatCompletionRequest) -> Response:
        """``POST /v1/chat/completions`` (tools: ``engine/server/tools.py``; reasoning: ``reasoning.py``)."""
        ctx = self.ctx
        args = ctx.engine.args
        self._check_common(req)
        for legacy, current in (("functions", "tools"), ("function_call", "tool_choice")):
            # OpenAI's deprecated fields answer with message.function_call / finish_reason "function_call", a shape
            # this server does not produce: refused rather than ignored (or answered in the tool_calls shape, which
            # a legacy client would not read).
            if getattr(req, legacy) is not None:
                raise InvalidRequestError(f"{legacy} (deprecated) is not supported; use {current} instead", legacy)
        functions = validate_tools(req.tools)
        choice = resolve_tool_choice(functions, req.tool_choice, args.tool_choice_as_auto)
        k = 0
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}", "top_logprobs"
                )
            k = req.top_logprobs
        sp = self._sampling(req, call_schema(functions, choice) if choice.forced else None)
        if choice.forced:
            mode = "forced"
        elif choice.mode == "auto" and sp.json_schema is None and sp.regex is None and sp.ebnf is None:
            mode = "auto"
        else:
            mode = "text"  # no tools, or a response_format shapes the reply: it is content, not a call
        names = {f["name"] for f in functions}
        opts = RenderOptions(
            functions=functions if choice.mode != "none" else None,
            flatten_tool_content=args.flatten_tool_content,
            accept_bare_image_url=args.accept_bare_image_url,
        )
        ids = await asyncio.to_thread(self._chat_prompt_ids, req, opts)  # off the event loop: may take seconds
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sp.max_new_tokens = resolve_max_tokens(
            requested, args.default_chat_max_tokens, len(ids), ctx.context_length, param, "messages"
        )
        rids = ctx.rids.claim(request_id_of(request.scope), 1)
        rid = rids[0]
        greq = GenerateRequest(
            rid=rid,
            input_ids=ids,
            sampling_params=sp,
            return_logprob=req.logprobs,
            top_logprobs_num=k,
            stream=req.stream,
            arrival_time=time.monotonic(),
        )
        group = self._group([greq], req.stream)
        if choice.forced:
            index = {f["name"]: i for i, f in enumerate(functions)}
            used = [f for f in functions if choice.mode == "required" or f["name"] == choice.name]
            group = ToolGrammarGroup(
                group,
                ctx.engine,
                [
                    (
                        f"tools[{index[f['name']]}].function.parameters",
                        json.dumps(call_schema([f], ToolChoice("required"))),
                    )
                    for f in used
                ],
            )
        n = req.n
        model = ctx.model_name
        with_reasoning = args.reasoning_parser is not None

        def parser() -> ChatOutputParser:
            return ChatOutputParser(mode, names, make_reasoning_stream(args.reasoning_parser))

        def usage_of(states: list[SampleState], parsers: list[ChatOutputParser]) -> Usage:
            return Usage.of(
                len(ids),
                sum(s.completion_tokens for s in states),
                max(s.cached_tokens for s in states),
                sum(p.reasoning_tokens for p in parsers) if with_reasoning else None,
            )

        async def collect(group: OutputGroup) -> Response:
            states = [SampleState() for _ in range(n)]
            parsers = [parser() for _ in range(n)]
            got = [ChoiceDelta() for _ in range(n)]

            def take(i: int, d: ChoiceDelta) -> None:
                got[i].reasoning += d.reasoning
                got[i].content += d.content
                if d.calls:
                    got[i].calls = d.calls

            async for _, out in group:
                states[out.index].add(out)
                take(out.index, parsers[out.index].feed(out.text, len(out.token_ids)))
            choices = []
            for i, st in enumerate(states):
                if _is_abort(st.finish_reason):
                    raise abort_error(st.finish_reason)
                take(i, parsers[i].finish())
                g = got[i]
                reasoning = parsers[i].reasoning
                has_reasoning = reasoning is not None and reasoning.has_reasoning
                content: str | None = g.content
                if g.calls or has_reasoning:
                    content = g.content.strip() or None
                calls = [
                    ToolCall(id=new_call_id(), function=FunctionCall(name=nm, arguments=a)) for nm, a in g.calls or []
                ]
                choices.append(
                    ChatCompletionChoice(
                        index=i,
                        message=ChatResponseMessage(
                            content=content,
                            reasoning_content=g.reasoning if has_reasoning else None,
                            tool_calls=calls or None,
                        ),
                        logprobs=self._chat_logprobs(st.logprobs, k) if req.logprobs else None,
                        finish_reason="tool_calls" if calls else openai_finish_reason(st.finish_reason),
                    )
                )
            usage = usage_of(states, parsers)
            resp = ChatCompletionResponse(id=chat_id(rid), model=model, choices=choices, usage=usage)
            return JSONResponse(resp.model_dump())

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks(group: OutputGroup) -> AsyncIterator[bytes]:
            cid, created = chat_id(rid), now()

            def chunk(choices: list[ChatCompletionStreamChoice], usage: Usage | None = None) -> bytes:
                d = ChatCompletionChunk(id=cid, created=created, model=model, choices=choices, usage=usage).model_dump()
                if not include_usage:
                    d.pop("usage")
                return sse(d)

            for i in range(n):
                yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            states = [SampleState() for _ in range(n)]
            parsers = [parser() for _ in range(n)]
            async for _, out in group:
                states[out.index].add(out)
                if _is_abort(out.finish_reason):
                    raise abort_error(out.finish_reason)
                p = parsers[out.index]
                d = p.feed(out.text, len(out.token_ids))
                if out.finish_reason is not None:
                    f = p.finish()
                    d = ChoiceDelta(d.reasoning + f.reasoning, d.content + f.content, f.calls)
                lps = self._chat_logprobs(out.logprobs or [], k) if req.logprobs and out.logprobs else None
                if not (d.content or d.reasoning or d.calls) and lps is None and out.finish_reason is None:
                    continue
                tool_deltas = [
                    ToolCallDelta(index=j, id=new_call_id(), type="function", function={"name": nm, "arguments": a})
                    for j, (nm, a) in enumerate(d.calls or [])
                ]
                delta = DeltaMessage(
                    content=d.content or None, reasoning_content=d.reasoning or None, tool_calls=tool_deltas or None
                )
                fr = "tool_calls" if tool_deltas else openai_finish_reason(out.finish_reason)
                yield chunk([ChatCompletionStreamChoice(index=out.index, delta=delta, logprobs=lps, finish_reason=fr)])
            if include_usage:
                yield chunk([], usage_of(states, parsers))
            yield SSE_DONE

        return await respond(self.ctx, request, group, rids, req.stream, collect, chunks)

    # ------------------------------------------------------------------------------------------------ completions

    def _chat_prompt_ids(self, req: Any, opts: RenderOptions | None = None) -> list[int]:
        """Messages -> chat template -> token ids (the template adds the special tokens itself)."""
        tok = self.ctx.engine.tokenizer
        opts = opts or RenderOptions()
        opts.caps = self.ctx.template_caps
        return encode_text(tok, render_prompt(tok, req, opts), "messages", add_special_tokens=False)

    def _prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
        """Normalize the four ``prompt`` forms to ``[(text or None, token ids)]``."""
        tok = self.ctx.engine.tokenizer
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        elif isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        out: list[tuple[str | None, list[int]]] = []
        for item in items:
            if isinstance(item, str):
                out.append((item, encode_text(tok, item, "prompt")))
            else:
                self.ctx.check_token_ids(item, "prompt")
                out.append((None, list(item)))
        return out

    async def completions(self, request: Request, req: CompletionRequest) -> Response:
        """``POST /v1/completions`` (legacy)."""
        ctx = self.ctx
        self._check_common(req)
        if req.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError("best_of other than n is not supported", "best_of")
        k = req.logprobs
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {k}", "logprobs")
        sp = self._sampling(req)
        prompts = await asyncio.to_thread(self._prompts, req.prompt)  # off the event loop: may take seconds
        reqs_sp = []
        for _, ids in prompts:
            # Absent or null → OpenAI's 16, clamped to the room left; an explicit value is checked strictly.
            requested = req.max_tokens if "max_tokens" in req.model_fields_set else None
            m = resolve_max_tokens(
                requested, DEFAULT_COMPLETION_MAX_TOKENS, len(ids), ctx.context_length, "max_tokens", "prompt"
            )
            reqs_sp.append(
                dataclasses.replace(sp, max_new_tokens=m, stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids))
            )
        base_rid = request_id_of(request.scope)
        rids = ctx.rids.claim(base_rid, len(prompts))
        arrival = time.monotonic()
        greqs = [
            GenerateRequest(
                rid=rid,
                input_ids=ids,
                sampling_params=p,
                return_logprob=k is not None,
                top_logprobs_num=k or 0,
                stream=req.stream,
                arrival_time=arrival,
            )
            for rid, (_, ids), p in zip(rids, prompts, reqs_sp)
        ]
        group = self._group(greqs, req.stream)
        n, model, cid = req.n, ctx.model_name, completion_id(base_rid)
        tok = ctx.engine.tokenizer
        echo_texts = [(text if text is not None else tok.decode(ids)) if req.echo else "" for text, ids in prompts]

        def usage_of(states: list[SampleState]) -> Usage:
            cached = sum(max(states[p * n + j].cached_tokens for j in range(n)) for p in range(len(prompts)))
            return Usage.of(sum(len(ids) for _, ids in prompts), sum(s.completion_tokens for s in states), cached)

        async def collect(group: OutputGroup) -> Response:
            states = [SampleState() for _ in range(len(prompts) * n)]
            async for pos, out in group:
                states[pos * n + out.index].add(out)
            choices = []
            for c, st in enumerate(states):
                if _is_abort(st.finish_reason):
                    raise abort_error(st.finish_reason)
                pos = c // n
                logprobs = None
                if k is not None:
                    offsets = TextOffsets(ctx.texts, sp.skip_special_tokens)
                    logprobs = self._legacy_logprobs(st.logprobs, k, offsets, prompts[pos][1] if req.echo else None)
                choices.append(
                    CompletionChoice(
                        index=c,
                        text=echo_texts[pos] + st.text,
                        logprobs=logprobs,
                        finish_reason=openai_finish_reason(st.finish_reason),
                    )
                )
            resp = CompletionResponse(id=cid, model=model, choices=choices, usage=usage_of(states))
            return JSONResponse(resp.model_dump())

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks(group: OutputGroup) -> AsyncIterator[bytes]:
            created = now()

            def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
                d = CompletionResponse(id=cid, created=created, model=model, choices=choices, usage=usage).model_dump()
                d.pop("system_fingerprint")
                if not include_usage:
                    d.pop("usage")
                return sse(d)

            states = [SampleState() for _ in range(len(prompts) * n)]
            offsets = [TextOffsets(ctx.texts, sp.skip_special_tokens) for _ in states]
            if req.echo:
                for c in range(len(states)):
                    pos = c // n
                    logprobs = None
                    if k is not None:
                        logprobs = self._legacy_logprobs([], k, offsets[c], prompts[pos][1])
                    yield chunk([CompletionChoice(index=c, text=echo_texts[pos], logprobs=logprobs)])
            async for pos, out in group:
                c = pos * n + out.index
                states[c].add(out)
                if _is_abort(out.finish_reason):
                    raise abort_error(out.finish_reason)
                logprobs = None
                if k is not None and out.logprobs:
                    logprobs = self._legacy_logprobs(out.logprobs, k, offsets[c])
                if not out.text and logprobs is None and out.finish_reason is None:
                    continue
                fr = openai_finish_reason(out.finish_reason)
                yield chunk([CompletionChoice(index=c, text=out.text, logprobs=logprobs, finish_reason=fr)])
            if include_usage:
                yield chunk([], usage_of(states))
            yield SSE_DONE

        return await respond(self.ctx, request, group, rids, req.stream, collect, chunks)
