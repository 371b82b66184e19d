"""``POST /v1/completions`` (legacy): one ``GenerateRequest`` per prompt, choices prompt-major (choice ``p * n + i``
is sample ``i`` of prompt ``p``), ``echo`` and legacy logprobs (after SGLang's
``entrypoints/openai/serving_completions.py``).

``echo`` with ``logprobs``: the engine scores the prompt too (``logprob_start_len`` 0), so every prompt token but the
first (nothing precedes it: null) has its logprob and top alternatives. A stream sends a choice's echoed prompt, with
those logprobs, just before the choice's first generated text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from radixserve.contracts.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
    now,
)
from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, ReqOutput, TokenLogprob
from radixserve.engine.server.common import (
    completion_id,
    encode_text,
    openai_finish_reason,
    request_id_of,
    resolve_max_tokens,
)
from radixserve.engine.server.generation import OutputGroup
from radixserve.engine.server.logprob_format import legacy_logprobs
from radixserve.engine.server.openai_params import check_completion
from radixserve.engine.server.openai_sampling import sampling_params
from radixserve.engine.server.output_groups import openai_group
from radixserve.engine.server.serving_base import Job, SampleState, Serving
from radixserve.engine.server.token_text import TextOffsets


@dataclass(kw_only=True)
class TextChoice(SampleState):
    """One choice and where its next token starts in its text (``text_offset``; after the echoed prompt)."""

    offsets: TextOffsets


@dataclass(kw_only=True)
class CompletionJob(Job[TextChoice]):
    """A completions request: its prompts ``[(text or None, token ids)]``, ``n``, ``samples`` per prompt (``best_of``
    candidates, else ``n``; results are prompt-major, ``samples`` per prompt), ``echo`` (the prompt texts to
    prepend), legacy ``logprobs`` (``k`` alternatives; None: none), usage options and response id."""

    prompts: list[tuple[str | None, list[int]]]
    n: int
    samples: int
    echo_texts: list[str] | None
    k: int | None
    include_usage: bool
    cid: str
    created: int = field(default_factory=now)


class CompletionServing(Serving[CompletionRequest, CompletionJob]):
    """``POST /v1/completions`` over ``ctx.engine``."""

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

    def prompt_token_ids(self, body: CompletionRequest) -> list[list[int]]:
        return [ids for _, ids in self._prompts(body.prompt)]

    async def build(self, request: Request, body: CompletionRequest) -> CompletionJob:
        ctx, req = self.ctx, body
        samples = check_completion(ctx, req)
        k = req.logprobs
        # echo + logprobs: the prompt tokens' logprobs too (the engine scores the prompt from position 0).
        prompt_logprobs = req.echo and k is not None
        sp = sampling_params(ctx, req)
        sp.n = samples
        prompts = await asyncio.to_thread(self._prompts, req.prompt)  # off the event loop: may take seconds
        # Absent or null → OpenAI's 16, clamped to the room left; an explicit value is checked strictly.
        requested = req.max_tokens if "max_tokens" in req.model_fields_set else None
        sps = [
            dataclasses.replace(
                sp,
                max_new_tokens=resolve_max_tokens(
                    requested, DEFAULT_COMPLETION_MAX_TOKENS, len(ids), ctx.context_length, "max_tokens", "prompt"
                ),
                stop=list(sp.stop),
                stop_token_ids=list(sp.stop_token_ids),
            )
            for _, ids in prompts
        ]
        tok = ctx.engine.tokenizer
        echo_texts = [text if text is not None else tok.decode(ids) for text, ids in prompts] if req.echo else None
        base_rid = request_id_of(request.scope)
        rids = ctx.rids.claim(base_rid, len(prompts))
        arrival = time.monotonic()
        greqs = [
            GenerateRequest(
                rid=rid,
                input_ids=ids,
                sampling_params=p,
                return_logprob=k is not None or samples > req.n,  # best_of ranks by logprob
                top_logprobs_num=k or 0,
                logprob_start_len=0 if prompt_logprobs else None,
                stream=req.stream,
                arrival_time=arrival,
            )
            for rid, (_, ids), p in zip(rids, prompts, sps)
        ]
        choices = [
            TextChoice(offsets=TextOffsets(ctx.texts, sp.skip_special_tokens)) for _ in range(len(prompts) * samples)
        ]
        return CompletionJob(
            reqs=greqs,
            results=choices,
            rids=rids,
            stream=req.stream,
            prompts=prompts,
            n=req.n,
            samples=samples,
            echo_texts=echo_texts,
            k=k,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            cid=completion_id(base_rid),
        )

    def output_group(self, job: CompletionJob) -> OutputGroup:
        return openai_group(self.ctx.engine, job.reqs, job.stream)

    # ------------------------------------------------------------------------------------------------ results

    def _usage(self, job: CompletionJob) -> Usage:
        n, states = job.samples, job.results  # every best_of candidate was generated: its tokens count (as OpenAI's)
        cached = sum(max(states[p * n + j].cached_tokens for j in range(n)) for p in range(len(job.prompts)))
        prompt_tokens = sum(len(ids) for _, ids in job.prompts)
        return Usage.of(prompt_tokens, sum(s.completion_tokens for s in states), cached)

    def _echo(self, job: CompletionJob, r: int) -> str:
        return job.echo_texts[r // job.samples] if job.echo_texts is not None else ""

    def _legacy(self, job: CompletionJob, r: int, lps: list[TokenLogprob], echo: bool = False) -> Any:
        """Legacy logprobs of ``lps``, tokens of result ``r`` (after its echoed prompt's with ``echo``); None unless
        the request asked for logprobs."""
        st = job.results[r]
        if job.k is None:
            return None
        if not echo or job.echo_texts is None:
            return legacy_logprobs(self.ctx.texts, lps, job.k, st.offsets)
        prompt_ids = job.prompts[r // job.samples][1]
        return legacy_logprobs(self.ctx.texts, lps, job.k, st.offsets, prompt_ids, st.input_logprobs)

    @staticmethod
    def _best(job: CompletionJob) -> list[int]:
        """The results to answer, choice order: with ``best_of`` each prompt's ``n`` candidates of highest mean
        token logprob (OpenAI's "highest log probability per token"; ties: the earlier sample), best first."""
        if job.samples == job.n:
            return list(range(len(job.results)))

        def score(r: int) -> float:
            lps = job.results[r].logprobs
            return sum(lp.logprob for lp in lps) / len(lps) if lps else 0.0

        out: list[int] = []
        for p in range(len(job.prompts)):
            candidates = range(p * job.samples, (p + 1) * job.samples)
            out.extend(sorted(candidates, key=lambda r: (-score(r), r))[: job.n])
        return out

    def final(self, job: CompletionJob) -> Any:
        choices = []
        for c, r in enumerate(self._best(job)):
            st = job.results[r]
            choices.append(
                CompletionChoice(
                    index=c,
                    text=self._echo(job, r) + st.text,
                    logprobs=self._legacy(job, r, st.logprobs, echo=True),
                    finish_reason=openai_finish_reason(st.finish_reason),
                )
            )
        resp = CompletionResponse(id=job.cid, model=self.ctx.model_name, choices=choices, usage=self._usage(job))
        return resp.model_dump()

    def _chunk(self, job: CompletionJob, choices: list[CompletionChoice], usage: Usage | None = None) -> dict[str, Any]:
        model = self.ctx.model_name
        d = CompletionResponse(id=job.cid, created=job.created, model=model, choices=choices, usage=usage).model_dump()
        d.pop("system_fingerprint")
        if not job.include_usage:
            d.pop("usage")
        return d

    def stream_result_head(self, job: CompletionJob, r: int) -> Iterable[dict[str, Any]]:
        if job.echo_texts is not None:  # the prompt's logprobs came with the choice's first delta
            logprobs = self._legacy(job, r, [], echo=True)
            yield self._chunk(job, [CompletionChoice(index=r, text=self._echo(job, r), logprobs=logprobs)])

    def stream_delta(self, job: CompletionJob, r: int, out: ReqOutput) -> dict[str, Any] | None:
        logprobs = self._legacy(job, r, out.logprobs) if out.logprobs else None
        if not out.text and logprobs is None and out.finish_reason is None:
            return None
        fr = openai_finish_reason(out.finish_reason)
        return self._chunk(job, [CompletionChoice(index=r, text=out.text, logprobs=logprobs, finish_reason=fr)])

    def stream_tail(self, job: CompletionJob) -> Iterable[dict[str, Any]]:
        if job.include_usage:
            yield self._chunk(job, [], self._usage(job))
