"""Scheduler-side state of one generation sample (``Req``).

A ``GenerateRequest`` with ``n`` samples becomes one ``Req`` that is prefilled once and then forked into ``n`` decoding
``Req`` objects sharing the prompt's KV slots through the radix tree (parallel sampling, as in SGLang).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from radixserve.engine.io_struct import GenerateRequest, SamplingParams, TokenLogprob
from radixserve.engine.scheduler.finish import FinishReason
from radixserve.engine.tokenizer.detokenize import IncrementalDetokenizer
from radixserve.engine.tokenizer.stop import StopStringMatcher


class Req:
    """One sample being generated.

    KV layout: ``req_to_token[req_pool_idx, :kv_len]`` holds the KV slots of ``fill_ids[:kv_len]``; the first
    ``prefix_len`` of them belong to the radix tree (kept alive by a lock on ``last_node``), the rest to this request.
    """

    def __init__(self, greq: GenerateRequest, index: int, tokenizer: Any, generator: torch.Generator | None):
        self.greq = greq
        self.rid = greq.rid
        self.index = index
        self.origin_input_ids: list[int] = greq.input_ids
        self.output_ids: list[int] = []
        self.params: SamplingParams = greq.sampling_params
        self.generator = generator
        self.return_logprob = greq.return_logprob
        self.top_logprobs_num = greq.top_logprobs_num
        # Prompt logprobs (input_logprobs.py): asked from this prompt position on, or None.
        self.logprob_start_len = greq.logprob_start_len
        self.input_logprobs: list[TokenLogprob | None] | None = None  # all of them, once the prompt is prefilled
        self.input_logprobs_partial: list[TokenLogprob] = []  # scored so far, over earlier prefill chunks
        self.input_logprobs_sent = False
        self.num_samples = greq.sampling_params.n  # > 1 only for a parent that still has to fork

        self.req_pool_idx: int | None = None
        self.prefix_len = 0  # tokens whose slots the radix tree owns
        self.last_node: Any = None  # locked radix node covering the prefix
        self.kv_len = 0  # tokens whose KV is computed (prefix + extended)
        self.extend_len = 0  # tokens extended in the current prefill batch
        self.cached_tokens = 0  # prompt tokens served from the radix cache (reported to the client)
        self.cached_tokens_set = False

        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=self.params.skip_special_tokens)
        self.stop_matcher = StopStringMatcher(self.params.stop, trim=not self.params.no_stop_trim)
        self.pending_text = ""  # text produced since the last ReqOutput
        self.pending_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.finish_reason: FinishReason | None = None
        # Constrained decoding: this sample's own grammar matcher (xgrammar). It has accepted exactly
        # ``output_ids`` (never the prompt), so prefix hits and retraction (which keeps ``output_ids``) leave it valid.
        self.grammar = greq.grammar
        self.matcher: Any = greq.grammar.matcher() if greq.grammar is not None else None

        self.arrival_time = greq.arrival_time or time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV the request needs: the prompt plus every generated token."""
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        """True while the request asked for prompt logprobs and they are not all computed yet."""
        return self.logprob_start_len is not None and self.input_logprobs is None

    def input_logprob_positions(self) -> range:
        """Prompt positions whose logits score a prompt token (position ``p`` scores token ``p + 1``):
        ``max(logprob_start_len - 1, 0) .. prompt_len - 2``; empty when no prompt logprobs are asked for."""
        if self.logprob_start_len is None:
            return range(0)
        return range(max(self.logprob_start_len - 1, 0), len(self.origin_input_ids) - 1)

    def max_prefix_len(self) -> int:
        """Tokens of ``fill_ids`` a radix-cache match may cover, so the tokens after it get logits: all but the last
        (its logits pick the next token), and while prompt logprobs are wanted, at most the first scored position
        (a cached prefix has no logits: positions from ``logprob_start_len - 1`` on must be prefilled)."""
        cap = len(self.fill_ids) - 1
        if self.wants_input_logprobs:
            cap = min(cap, self.input_logprob_positions().start)
        return max(cap, 0)

    def max_new_tokens(self, context_length: int) -> int:
        """Tokens this sample may generate: ``max_new_tokens``, or up to the context when it is None."""
        m = self.params.max_new_tokens
        return context_length - len(self.origin_input_ids) if m is None else m

    def reset_kv_state(self) -> None:
        """Forget KV placement (after the scheduler released it) so the request can be prefilled again (retract)."""
        self.req_pool_idx = None
        self.prefix_len = 0
        self.last_node = None
        self.kv_len = 0
        self.extend_len = 0
        self.input_logprobs_partial = []  # prompt logprobs not complete yet: the re-prefill scores them again

    def __repr__(self) -> str:
        return (
            f"Req(rid={self.rid!r}, index={self.index}, prompt={len(self.origin_input_ids)}, "
            f"out={len(self.output_ids)})"
        )
