"""Output processing: sampled tokens -> request state, finish checks, streamed ``ReqOutput`` deltas.

Per sampled row: append the token, detokenize incrementally (tokenizer/detokenize.py), feed the stop-string matcher
(tokenizer/stop.py), and decide whether the sample finished (eos / stop token, stop string, grammar end, length). As
SGLang's ``process_batch_result`` + ``check_finished`` (srt/managers/scheduler_output_processor_mixin.py,
schedule_batch.py). KV release is not done here: the caller hands finished samples to ``KVCacheManager.cache_req``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from radixserve.engine.io_struct import ReqOutput
from radixserve.engine.scheduler.config import SchedulerConfig
from radixserve.engine.scheduler.finish import FinishKind, FinishReason
from radixserve.engine.scheduler.request import Req
from radixserve.engine.scheduler.sample_step import SampledTokens


class OutputProcessor:
    """Turns a step's sampled tokens into request state and ``ReqOutput`` deltas.

    Args:
        eos_token_ids: the model's end-of-sequence tokens (ignored under ``ignore_eos``, unless a grammar ended).
        config: ``context_length`` and ``stream_interval``.
        metrics: ``EngineMetrics`` or None.
    """

    def __init__(self, eos_token_ids: set[int], config: SchedulerConfig, metrics: Any = None):
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.metrics = metrics

    def process(self, reqs: Sequence[Req], sampled: SampledTokens, outputs: list[ReqOutput]) -> list[Req]:
        """Apply ``sampled`` (one row per entry of ``reqs``); append deltas to ``outputs``; return the samples that
        finished in this step (finish reason set, last delta emitted, KV still held)."""
        now = time.monotonic()
        m = self.metrics
        finished: list[Req] = []
        generated = 0
        for req, tok, lp, rejected, grammar_done, dead_end in zip(
            reqs, sampled.token_ids, sampled.logprobs, sampled.rejected, sampled.grammar_done, sampled.dead_end
        ):
            if rejected:
                if m is not None:
                    m.grammar_aborts_total.inc()
                if dead_end:  # the client's constraint, not our bug: a 400 (regression: the regex a[^\s\S] was a 500)
                    n = len(req.output_ids)
                    why = f"invalid constraint: no string it matches starts with the {n} token(s) generated so far"
                    reason = FinishReason.abort(why, 400)
                else:
                    reason = FinishReason.abort(f"constrained decoding failed: the grammar rejected token {tok}", 500)
                self.finish(req, reason, outputs)
                finished.append(req)
                continue
            req.output_ids.append(tok)
            generated += 1
            if m is not None:
                if req.first_token_time is None:
                    m.time_to_first_token_seconds.observe(now - req.arrival_time)
                elif req.last_token_time is not None:
                    m.inter_token_latency_seconds.observe(now - req.last_token_time)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            req.pending_ids.append(tok)
            if lp is not None:
                req.pending_logprobs.append(lp)
            stop = self._check_finish(req, tok, grammar_done)
            if stop is not None:
                self.finish(req, stop, outputs)
                finished.append(req)
            elif len(req.output_ids) % self.config.stream_interval == 0 or len(req.output_ids) == 1:
                outputs.append(self.make_output(req))
        if m is not None and generated:
            m.generation_tokens_total.inc(generated)
        return finished

    def _check_finish(self, req: Req, tok: int, grammar_done: bool) -> FinishReason | None:
        """The reason ``req`` finished with ``tok`` (already appended), or None; feeds the detokenizer unless a stop
        token ended it (its text is never shown)."""
        p = req.params
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            return FinishReason.stop(tok)
        if grammar_done and tok in self.eos_token_ids:  # the grammar ended with eos (even under ignore_eos)
            return FinishReason.stop(tok)
        new_text = req.detokenizer.add_tokens([tok])
        if len(req.output_ids) < p.min_new_tokens:  # vLLM: no stop string ends an output short of min_tokens
            req.pending_text += new_text
        else:
            text, matched = req.stop_matcher.feed(new_text)
            req.pending_text += text
            if matched is not None:
                return FinishReason.stop(matched)
        if grammar_done:  # the grammar ended without a stop token (cannot happen with xgrammar's stop ids)
            return FinishReason.stop(None)
        if len(req.output_ids) >= req.max_new_tokens(self.config.context_length):
            return FinishReason.length()
        if req.seq_len >= self.config.context_length:
            return FinishReason.length()
        return None

    def finish(self, req: Req, reason: FinishReason, outputs: list[ReqOutput]) -> None:
        """Finish ``req``: flush held-back text (unless a stop string matched), emit the last delta, count it.

        A stop string found in the flushed text wins over a length finish (not over an abort)."""
        if not reason.matched_stop_string:
            text, matched = req.stop_matcher.feed(req.detokenizer.flush())
            req.pending_text += text
            if matched is not None and reason.kind is not FinishKind.ABORT:
                reason = FinishReason.stop(matched)
            else:
                req.pending_text += req.stop_matcher.flush()
        req.finish_reason = reason
        req.matcher = None  # free the grammar state now; the Req object may outlive the request briefly
        outputs.append(self.make_output(req))
        m = self.metrics
        if m is not None:
            m.num_requests_total.inc()
            if reason.kind is FinishKind.ABORT:
                m.num_aborted_requests_total.inc()
            m.e2e_request_latency_seconds.observe(time.monotonic() - req.arrival_time)

    def make_output(self, req: Req) -> ReqOutput:
        """The delta since the previous one (text, tokens, logprobs; the prompt's logprobs on the first delta after
        they are complete); resets the pending buffers."""
        out = ReqOutput(
            rid=req.rid,
            index=req.index,
            text=req.pending_text,
            token_ids=req.pending_ids,
            logprobs=req.pending_logprobs if req.return_logprob else None,
            finish_reason=req.finish_reason.to_dict() if req.finish_reason is not None else None,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
        )
        if req.input_logprobs is not None and not req.input_logprobs_sent:  # the prompt's logprobs, once
            out.input_token_logprobs = req.input_logprobs
            req.input_logprobs_sent = True
        req.pending_text, req.pending_ids, req.pending_logprobs = "", [], []
        return out
