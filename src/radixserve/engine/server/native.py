"""SGLang's native ``POST /generate`` (shape in docs/contracts.md, "Native POST /generate").

One ``GenerateRequest`` per prompt; a list of prompts (``[str]`` or ``[[int]]``) or ``n > 1`` gives a list of
results, ordered prompt-major (prompt 0's samples, then prompt 1's ...). Streaming sends one SSE chunk per engine delta
with the same shape (incremental ``text`` and ``output_ids``) plus ``index`` (the result's position), then
``data: [DONE]``. Aborted requests report ``finish_reason.type == "abort"`` in the result.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request
from starlette.responses import Response

from radixserve.contracts.protocol import MAX_TOP_LOGPROBS, GenerateReqInput
from radixserve.contracts.sse import SSE_DONE, sse
from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, SamplingParams, TokenLogprob
from radixserve.engine.server.common import (
    SampleState,
    ServerContext,
    encode_text,
    request_id_of,
    resolve_max_tokens,
)
from radixserve.engine.server.generation import GenerationGroup, respond


class NativeServing:
    """Handler of ``POST /generate`` over one engine."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx

    def _prompts(self, body: GenerateReqInput) -> tuple[list[list[int]], bool]:
        tok = self.ctx.engine.tokenizer
        if (body.text is None) == (body.input_ids is None):
            raise InvalidRequestError("give exactly one of text and input_ids", "text")
        if body.text is not None:
            if isinstance(body.text, str):
                return [encode_text(tok, body.text, "text")], False
            if not body.text:
                raise InvalidRequestError("text must not be an empty list", "text")
            return [encode_text(tok, t, "text") for t in body.text], True
        ids = body.input_ids
        if ids and isinstance(ids[0], list):
            prompts = [list(x) for x in ids]
            batch = True
        else:
            prompts = [list(ids or [])]  # type: ignore[arg-type]
            batch = False
        for p in prompts:
            self.ctx.check_token_ids(p, "input_ids")
        return prompts, batch

    def _sampling(self, raw: dict[str, Any], prompt_len: int) -> SamplingParams:
        defaults = getattr(self.ctx.engine, "sampling_defaults", {})  # --preferred-sampling-params
        sp = SamplingParams.from_dict({**defaults, **raw})
        requested = raw.get("max_new_tokens") if "max_new_tokens" in raw else None
        default = SamplingParams().max_new_tokens if "max_new_tokens" not in raw else None
        sp.max_new_tokens = None
        sp.validate(self.ctx.engine.vocab_size)
        sp.max_new_tokens = resolve_max_tokens(
            requested, default, prompt_len, self.ctx.context_length, "max_new_tokens", "input_ids"
        )
        return sp

    def _logprob_fields(self, lps: list[TokenLogprob], k: int, with_text: bool) -> dict[str, Any]:
        """SGLang's ``output_token_logprobs`` ``[[logprob, id, text|null]]`` and ``output_top_logprobs``."""
        texts = self.ctx.texts

        def entry(t: int, v: float) -> list[Any]:
            return [v, t, texts.text(t) if with_text else None]

        return {
            "output_token_logprobs": [entry(lp.token_id, lp.logprob) for lp in lps],
            "output_top_logprobs": [[entry(t, v) for t, v in lp.top[:k]] for lp in lps],
        }

    async def generate(self, request: Request, body: GenerateReqInput) -> Response:
        """``POST /generate``."""
        ctx = self.ctx
        # Tokenizing a multi-MiB prompt takes seconds: keep it off the event loop.
        prompts, batch = await asyncio.to_thread(self._prompts, body)
        raw_sps = body.sampling_params
        if isinstance(raw_sps, list):
            if len(raw_sps) != len(prompts):
                raise InvalidRequestError("sampling_params list must have one entry per prompt", "sampling_params")
        else:
            raw_sps = [raw_sps or {}] * len(prompts)
        sps = [self._sampling(raw, len(p)) for raw, p in zip(raw_sps, prompts)]
        k = body.top_logprobs_num
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {k}", "top_logprobs_num"
            )
        if isinstance(body.rid, list):
            if not batch or len(body.rid) != len(prompts):
                raise InvalidRequestError("rid list must have one entry per prompt", "rid")
            rids = [r for base in body.rid for r in ctx.rids.claim(base, 1)]
        else:
            rids = ctx.rids.claim(body.rid or request_id_of(request.scope), len(prompts))
        arrival = time.monotonic()
        greqs = [
            GenerateRequest(
                rid=rid,
                input_ids=ids,
                sampling_params=sp,
                return_logprob=body.return_logprob,
                top_logprobs_num=k,
                stream=body.stream,
                arrival_time=arrival,
            )
            for rid, ids, sp in zip(rids, prompts, sps)
        ]
        group = GenerationGroup(ctx.engine, greqs)
        first_result = [0]
        for sp in sps:
            first_result.append(first_result[-1] + sp.n)
        total = first_result[-1]

        def meta(pos: int, index: int, st: SampleState, lps: list[TokenLogprob] | None) -> dict[str, Any]:
            n = sps[pos].n
            m: dict[str, Any] = {
                "id": rids[pos] if n == 1 else f"{rids[pos]}-{index}",
                "prompt_tokens": len(prompts[pos]),
                "completion_tokens": st.completion_tokens,
                "cached_tokens": st.cached_tokens,
                "finish_reason": st.finish_reason,
            }
            if body.return_logprob:
                m.update(self._logprob_fields(lps or [], k, body.return_text_in_logprobs))
            return m

        async def collect(group: GenerationGroup) -> Response:
            states = [SampleState() for _ in range(total)]
            where = [(pos, i) for pos, sp in enumerate(sps) for i in range(sp.n)]
            async for pos, out in group:
                states[first_result[pos] + out.index].add(out)
            results = [
                {"text": st.text, "output_ids": st.token_ids, "meta_info": meta(pos, i, st, st.logprobs)}
                for st, (pos, i) in zip(states, where)
            ]
            return JSONResponse(results if batch or total > 1 else results[0])

        async def chunks(group: GenerationGroup) -> AsyncIterator[bytes]:
            states = [SampleState() for _ in range(total)]
            async for pos, out in group:
                r = first_result[pos] + out.index
                st = states[r]
                st.add(out)
                if not out.text and not out.token_ids and out.finish_reason is None:
                    continue
                yield sse(
                    {
                        "text": out.text,
                        "output_ids": out.token_ids,
                        "meta_info": meta(pos, out.index, st, out.logprobs),
                        "index": r,
                    }
                )
            yield SSE_DONE

        return await respond(self.ctx, request, group, rids, body.stream, collect, chunks)
