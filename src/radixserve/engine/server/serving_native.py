"""SGLang's native ``POST /generate`` (shape in docs/contracts.md, "Native POST /generate").

One ``GenerateRequest`` per prompt; a list of prompts (``[str]`` or ``[[int]]``) or ``n > 1`` gives a list of
results, ordered prompt-major (prompt 0's samples, then prompt 1's ...). Streaming sends one SSE event per engine
delta with the same shape (incremental ``text`` and ``output_ids``) plus ``index`` (the result's position), then
``data: [DONE]``. Aborted requests report ``finish_reason.type == "abort"`` in the result, not as an error.

Logprobs (``return_logprob``): ``meta_info.output_token_logprobs`` / ``output_top_logprobs`` (a streamed event: its
delta's), and ``input_token_logprobs`` / ``input_top_logprobs``, the prompt tokens' from ``logprob_start_len`` on
(-1, the default: none, empty lists; every streamed event of a result carries them whole).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from starlette.requests import Request

from radixserve.contracts.protocol import MAX_TOP_LOGPROBS, GenerateReqInput
from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, ReqOutput, SamplingParams, TokenLogprob
from radixserve.engine.server.common import encode_text, request_id_of, resolve_max_tokens
from radixserve.engine.server.logprob_format import native_input_logprobs, native_output_logprobs
from radixserve.engine.server.serving_base import Job, SampleState, Serving


@dataclass(kw_only=True)
class NativeResult(SampleState):
    """One result: its ``meta_info.id`` (the request's rid, ``rid-i`` for sample ``i`` when ``n > 1``), its prompt's
    token ids and where its prompt logprobs start (None: none asked)."""

    id: str
    prompt: list[int]
    logprob_start: int | None


@dataclass(kw_only=True)
class NativeJob(Job[NativeResult]):
    """A ``/generate`` request: whether it was a batch (the answer is then a list), and its logprob options."""

    batch: bool
    return_logprob: bool
    top_k: int
    text_in_logprobs: bool


class NativeServing(Serving[GenerateReqInput, NativeJob]):
    """``POST /generate`` over ``ctx.engine``."""

    aborts_are_errors: ClassVar[bool] = False

    def _prompts(self, body: GenerateReqInput) -> tuple[list[list[int]], bool]:
        """The prompts' token ids and whether the request is a batch. Raises ``InvalidRequestError`` (400)."""
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

    def prompt_token_ids(self, body: GenerateReqInput) -> list[list[int]]:
        return self._prompts(body)[0]

    @staticmethod
    def _logprob_starts(body: GenerateReqInput, prompts: list[list[int]], batch: bool) -> list[int | None]:
        """Each prompt's ``logprob_start_len`` for the engine (None: no prompt logprobs; always None without
        ``return_logprob``, as SGLang ignores it then). Raises ``InvalidRequestError`` (400) for a list that does not
        match the prompts, or a value that is neither -1 nor a position of its prompt."""
        raw = body.logprob_start_len
        if isinstance(raw, list):
            if len(raw) != len(prompts):  # a one-entry list for one prompt is its value (new-user try: was a 400)
                raise InvalidRequestError(
                    f"logprob_start_len list must have one entry per prompt ({len(prompts)}), got {len(raw)}",
                    "logprob_start_len",
                )
            starts, params = raw, [f"logprob_start_len[{i}]" for i in range(len(raw))]
        else:
            starts, params = [raw] * len(prompts), ["logprob_start_len"] * len(prompts)
        for start, ids, param in zip(starts, prompts, params):
            if start != -1 and not 0 <= start < len(ids):
                raise InvalidRequestError(
                    f"{param} must be -1 (no prompt logprobs) or a position of the prompt, in [0, {len(ids)}): "
                    f"the prompt has {len(ids)} tokens, got {start}",
                    param,
                )
        return [s if body.return_logprob and s != -1 else None for s in starts]

    def _sampling(self, raw: dict[str, Any], prompt_len: int) -> SamplingParams:
        """``sampling_params`` over the engine's ``--preferred-sampling-params``; ``max_new_tokens`` defaults to 128,
        clamped to the room left. Raises ``InvalidRequestError`` (400) for unknown keys and bad values."""
        sp = SamplingParams.from_dict({**self.ctx.engine.sampling_defaults, **raw})
        requested = raw.get("max_new_tokens") if "max_new_tokens" in raw else None
        default = SamplingParams().max_new_tokens if "max_new_tokens" not in raw else None
        sp.max_new_tokens = None
        sp.validate(self.ctx.engine.vocab_size)
        # The minimum against the client's own maximum (validate saw none; regression: 5 > 3 answered 3 tokens).
        if isinstance(requested, int) and not isinstance(requested, bool) and 0 <= requested < sp.min_new_tokens:
            raise InvalidRequestError(
                f"min_new_tokens ({sp.min_new_tokens}) must be at most max_new_tokens ({requested})", "min_new_tokens"
            )
        sp.max_new_tokens = resolve_max_tokens(
            requested, default, prompt_len, self.ctx.context_length, "max_new_tokens", "input_ids"
        )
        return sp

    async def build(self, request: Request, body: GenerateReqInput) -> NativeJob:
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
        starts = self._logprob_starts(body, prompts, batch)
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
                logprob_start_len=start,
                stream=body.stream,
                arrival_time=arrival,
            )
            for rid, ids, sp, start in zip(rids, prompts, sps, starts)
        ]
        results = [
            NativeResult(id=rid if sp.n == 1 else f"{rid}-{i}", prompt=ids, logprob_start=start)
            for rid, ids, sp, start in zip(rids, prompts, sps, starts)
            for i in range(sp.n)
        ]
        return NativeJob(
            reqs=greqs,
            results=results,
            rids=rids,
            stream=body.stream,
            batch=batch,
            return_logprob=body.return_logprob,
            top_k=k,
            text_in_logprobs=body.return_text_in_logprobs,
        )

    # ------------------------------------------------------------------------------------------------ results

    def _meta(self, job: NativeJob, st: NativeResult, lps: list[TokenLogprob] | None) -> dict[str, Any]:
        """``meta_info`` of a result (or of one streamed delta of it: ``lps`` are that delta's logprobs)."""
        m: dict[str, Any] = {
            "id": st.id,
            "prompt_tokens": len(st.prompt),
            "completion_tokens": st.completion_tokens,
            "cached_tokens": st.cached_tokens,
            "finish_reason": st.finish_reason,
        }
        if job.return_logprob:
            texts, k, with_text = self.ctx.texts, job.top_k, job.text_in_logprobs
            m.update(native_output_logprobs(texts, lps or [], k, with_text))
            start, prompt_lps = st.logprob_start, st.input_logprobs
            if start is None or prompt_lps is None:  # none asked (or the request ended before its prefill)
                m.update(input_token_logprobs=[], input_top_logprobs=[])
            else:
                m.update(native_input_logprobs(texts, st.prompt, start, prompt_lps, k, with_text))
        return m

    def final(self, job: NativeJob) -> Any:
        results = [
            {"text": st.text, "output_ids": st.token_ids, "meta_info": self._meta(job, st, st.logprobs)}
            for st in job.results
        ]
        return results if job.batch or len(results) > 1 else results[0]

    def stream_delta(self, job: NativeJob, r: int, out: ReqOutput) -> dict[str, Any] | None:
        if not out.text and not out.token_ids and out.finish_reason is None:
            return None
        meta = self._meta(job, job.results[r], out.logprobs)
        return {"text": out.text, "output_ids": out.token_ids, "meta_info": meta, "index": r}
