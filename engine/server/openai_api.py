"""OpenAI ``/v1/chat/completions`` and ``/v1/completions`` as a thin translation over the engine's generate.

After SGLang's ``srt/entrypoints/openai/serving_chat.py`` / ``serving_completions.py``: validate everything that can be
validated (model, unsupported features, sampling ranges, context length), tokenize, submit one ``GenerateRequest`` per
prompt (``n`` samples share it), wait for the first output (so 429/503 are HTTP errors even when streaming), then either
collect the whole answer or stream SSE chunks ending with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, AsyncIterator

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, SamplingParams, TokenLogprob
from radixserve.engine.server.chat import check_unsupported, render_prompt
from radixserve.engine.server.common import (
    SSE_DONE,
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
    sse,
)
from radixserve.engine.server.generation import GenerationGroup, respond
from radixserve.protocol import (
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
    Usage,
    now,
)

logger = logging.getLogger("radixserve.engine.server")

_OpenAIRequest = ChatCompletionRequest | CompletionRequest


def _is_abort(fr: dict[str, Any] | None) -> bool:
    return fr is not None and fr.get("type") == "abort"


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

    def _sampling(self, req: _OpenAIRequest) -> SamplingParams:
        """SamplingParams with OpenAI's defaults; ``max_new_tokens`` is set later, once the prompt length is known."""
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        defaults = getattr(self.ctx.engine, "sampling_defaults", {})  # --preferred-sampling-params
        json_schema = req.json_schema
        if json_schema is not None and not isinstance(json_schema, str):
            json_schema = str(json_schema)
        sp = SamplingParams(
            max_new_tokens=None,
            temperature=defaults.get("temperature", 1.0) if req.temperature is None else req.temperature,
            top_p=defaults.get("top_p", 1.0) if req.top_p is None else req.top_p,
            top_k=defaults.get("top_k", -1) if req.top_k is None else req.top_k,
            min_p=defaults.get("min_p", 0.0) if req.min_p is None else req.min_p,
            presence_penalty=defaults.get("presence_penalty", 0.0) if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=defaults.get("frequency_penalty", 0.0) if req.frequency_penalty is None else req.frequency_penalty,
            repetition_penalty=defaults.get("repetition_penalty", 1.0) if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            n=req.n,
            json_schema=json_schema,
            regex=req.regex,
            ebnf=req.ebnf,
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
        """``POST /v1/chat/completions``."""
        ctx = self.ctx
        self._check_common(req)
        check_unsupported(req)
        k = 0
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}", "top_logprobs"
                )
            k = req.top_logprobs
        sp = self._sampling(req)
        ids = await asyncio.to_thread(self._chat_prompt_ids, req)  # off the event loop: may take seconds
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        sp.max_new_tokens = resolve_max_tokens(requested, None, len(ids), ctx.context_length, param, "messages")
        rids = ctx.rids.claim(request_id_of(request.scope), 1)
        rid = rids[0]
        greq = GenerateRequest(
            rid=rid, input_ids=ids, sampling_params=sp, return_logprob=req.logprobs, top_logprobs_num=k,
            stream=req.stream, arrival_time=time.monotonic(),
        )
        group = GenerationGroup(ctx.engine, [greq])
        n = req.n
        model = ctx.model_name

        async def collect(group: GenerationGroup) -> Response:
            states = [SampleState() for _ in range(n)]
            async for _, out in group:
                states[out.index].add(out)
            choices = []
            for i, st in enumerate(states):
                if _is_abort(st.finish_reason):
                    raise abort_error(st.finish_reason)  # type: ignore[arg-type]
                choices.append(
                    ChatCompletionChoice(
                        index=i,
                        message=ChatResponseMessage(content=st.text),
                        logprobs=self._chat_logprobs(st.logprobs, k) if req.logprobs else None,
                        finish_reason=openai_finish_reason(st.finish_reason),
                    )
                )
            usage = Usage.of(len(ids), sum(s.completion_tokens for s in states), max(s.cached_tokens for s in states))
            resp = ChatCompletionResponse(id=chat_id(rid), model=model, choices=choices, usage=usage)
            return JSONResponse(resp.model_dump())

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks(group: GenerationGroup) -> AsyncIterator[bytes]:
            cid, created = chat_id(rid), now()

            def chunk(choices: list[ChatCompletionStreamChoice], usage: Usage | None = None) -> bytes:
                d = ChatCompletionChunk(id=cid, created=created, model=model, choices=choices, usage=usage).model_dump()
                if not include_usage:
                    d.pop("usage")
                return sse(d)

            for i in range(n):
                yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            states = [SampleState() for _ in range(n)]
            async for _, out in group:
                states[out.index].add(out)
                if _is_abort(out.finish_reason):
                    raise abort_error(out.finish_reason)  # type: ignore[arg-type]
                lps = self._chat_logprobs(out.logprobs or [], k) if req.logprobs and out.logprobs else None
                if not out.text and lps is None and out.finish_reason is None:
                    continue
                delta = DeltaMessage(content=out.text) if out.text else DeltaMessage()
                fr = openai_finish_reason(out.finish_reason)
                yield chunk([ChatCompletionStreamChoice(index=out.index, delta=delta, logprobs=lps, finish_reason=fr)])
            if include_usage:
                usage = Usage.of(
                    len(ids), sum(s.completion_tokens for s in states), max(s.cached_tokens for s in states)
                )
                yield chunk([], usage)
            yield SSE_DONE

        return await respond(self.ctx, request, group, rids, req.stream, collect, chunks)

    # ------------------------------------------------------------------------------------------------ completions

    def _chat_prompt_ids(self, req: Any) -> list[int]:
        """Messages -> chat template -> token ids (the template adds the special tokens itself)."""
        tok = self.ctx.engine.tokenizer
        return encode_text(tok, render_prompt(tok, req), "messages", add_special_tokens=False)

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
        fmt = req.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            raise InvalidRequestError(
                f"response_format {fmt.get('type')!r} is not supported yet (constrained decoding)", "response_format"
            )
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
                rid=rid, input_ids=ids, sampling_params=p, return_logprob=k is not None, top_logprobs_num=k or 0,
                stream=req.stream, arrival_time=arrival,
            )
            for rid, (_, ids), p in zip(rids, prompts, reqs_sp)
        ]
        group = GenerationGroup(ctx.engine, greqs)
        n, model, cid = req.n, ctx.model_name, completion_id(base_rid)
        tok = ctx.engine.tokenizer
        echo_texts = [(text if text is not None else tok.decode(ids)) if req.echo else "" for text, ids in prompts]

        def usage_of(states: list[SampleState]) -> Usage:
            cached = sum(max(states[p * n + j].cached_tokens for j in range(n)) for p in range(len(prompts)))
            return Usage.of(sum(len(ids) for _, ids in prompts), sum(s.completion_tokens for s in states), cached)

        async def collect(group: GenerationGroup) -> Response:
            states = [SampleState() for _ in range(len(prompts) * n)]
            async for pos, out in group:
                states[pos * n + out.index].add(out)
            choices = []
            for c, st in enumerate(states):
                if _is_abort(st.finish_reason):
                    raise abort_error(st.finish_reason)  # type: ignore[arg-type]
                pos = c // n
                logprobs = None
                if k is not None:
                    offsets = TextOffsets(ctx.texts, sp.skip_special_tokens)
                    logprobs = self._legacy_logprobs(st.logprobs, k, offsets, prompts[pos][1] if req.echo else None)
                choices.append(
                    CompletionChoice(
                        index=c, text=echo_texts[pos] + st.text, logprobs=logprobs,
                        finish_reason=openai_finish_reason(st.finish_reason),
                    )
                )
            resp = CompletionResponse(id=cid, model=model, choices=choices, usage=usage_of(states))
            return JSONResponse(resp.model_dump())

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def chunks(group: GenerationGroup) -> AsyncIterator[bytes]:
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
                    raise abort_error(out.finish_reason)  # type: ignore[arg-type]
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
