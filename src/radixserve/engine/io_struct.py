"""Typed messages between the engine's stages: HTTP server -> scheduler -> HTTP server.

Data flows one way: the server tokenizes and validates a request into a ``GenerateRequest``; the scheduler thread runs
it and pushes ``ReqOutput`` deltas back; the server turns those into native or OpenAI responses.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_NEW_TOKENS = 128
# torch.Generator.manual_seed takes [-2**63, 2**64); samples of one request use seed + index (wrapped mod 2**64).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# Constraint fields of SamplingParams (at most one per request); see engine/grammar.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
# OpenAI's logit_bias range; a bias at either bound is a ban / an exclusive choice (OpenAI's reference says -100 and
# 100 "should result in a ban or exclusive selection"), applied as LOGIT_BIAS_HARD, which outweighs any logit
# difference a model produces yet stays finite (a grammar's -inf mask still wins, and a banned token the grammar
# leaves alone is still chosen rather than nothing).
LOGIT_BIAS_BOUND = 100.0
LOGIT_BIAS_HARD = 1e4
MAX_LOGIT_BIAS_ENTRIES = 1024  # per request: the sampler touches each entry once per step
# Where SamplingParams keeps its parsed logit_bias: an instance attribute, not a dataclass field, so it is neither a
# parameter (from_dict, the docs) nor compared; dataclasses.replace drops it and bias_entries parses again.
_BIAS_CACHE = "_bias_entries"


class InvalidRequestError(ValueError):
    """A client error found while validating a request; the server answers 400 with ``message`` (and ``param``)."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code


@dataclass
class SamplingParams:
    """Per-request sampling parameters (SGLang's names; docs/contracts.md, "Native POST /generate").

    Units: ``max_new_tokens`` in tokens; probabilities in [0, 1]. ``top_k`` -1 (or 0) means disabled.
    """

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    # Tokens generated before an eos or stop_token_ids token may be sampled and stop strings are checked (vLLM's
    # ``min_tokens``); a constraint (json_schema / regex / ebnf) still ends where its grammar ends.
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: token id (decimal text, as JSON object keys are) -> bias in [-100, 100] added to that
    # token's logit before sampling or greedy choice; the bounds ban / force (LOGIT_BIAS_HARD). None or {}: none.
    logit_bias: dict[str, float] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a JSON dict; unknown keys raise ``InvalidRequestError``."""
        d = dict(d or {})
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise InvalidRequestError(f"unknown sampling_params: {', '.join(unknown)}", "sampling_params")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        for k in ("stop", "stop_token_ids"):
            if d.get(k) is None:
                d.pop(k, None)
        try:
            return cls(**d)
        except TypeError as e:  # pragma: no cover - dataclass arg errors
            raise InvalidRequestError(str(e), "sampling_params") from e

    def validate(self, vocab_size: int) -> None:
        """Check ranges; raises ``InvalidRequestError`` naming the parameter."""

        def bad(name: str, why: str) -> None:
            raise InvalidRequestError(f"{name} {why}, got {getattr(self, name)!r}", name)

        def is_num(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not is_num(getattr(self, name)):
                bad(name, "must be a number")
        if self.max_new_tokens is not None and (
            not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 0
        ):
            bad("max_new_tokens", "must be an integer >= 0")
        if not isinstance(self.min_new_tokens, int) or isinstance(self.min_new_tokens, bool) or self.min_new_tokens < 0:
            bad("min_new_tokens", "must be an integer >= 0")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", f"must be at most max_new_tokens ({self.max_new_tokens})")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if (
            not isinstance(self.top_k, int)
            or isinstance(self.top_k, bool)
            or (self.top_k < 1 and self.top_k not in (-1, 0))
        ):
            bad("top_k", "must be -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", "must be in (0, 2]")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            bad("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}]")
        for name in ("ignore_eos", "no_stop_trim", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be a boolean")
        for name in ("json_schema", "regex", "ebnf"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                bad(name, "must be a string")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= 128:
            bad("n", "must be an integer in [1, 128]")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            bad("stop", "may hold at most 16 strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in self.stop_token_ids
        ):
            bad("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        kinds = [k for k in GRAMMAR_FIELDS if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise InvalidRequestError(f"give at most one of json_schema, regex, ebnf; got {', '.join(kinds)}", kinds[1])
        # The grammar itself is compiled (and refused with a 400 when invalid) by the engine's grammar backend.
        if self.logit_bias is not None:
            self.__dict__[_BIAS_CACHE] = parse_logit_bias(self.logit_bias, vocab_size)

    def bias_entries(self) -> tuple[list[int], list[float]]:
        """``logit_bias`` as ``(token ids, additive biases)`` (the bounds as ``±LOGIT_BIAS_HARD``); empty lists
        without one. Parsed once per object; the values are assumed validated (``validate``)."""
        cached: tuple[list[int], list[float]] | None = self.__dict__.get(_BIAS_CACHE)
        if cached is None:
            cached = self.__dict__[_BIAS_CACHE] = parse_logit_bias(self.logit_bias or {}, None)
        return cached

    def grammar_key(self) -> tuple[str, str] | None:
        """``(kind, text)`` of the request's constraint (``json_schema``, ``regex`` or ``ebnf``), or None."""
        for k in GRAMMAR_FIELDS:
            v = getattr(self, k)
            if v is not None:
                return k, v
        return None


def parse_logit_bias(raw: Any, vocab_size: int | None) -> tuple[list[int], list[float]]:
    """OpenAI's ``logit_bias`` ``{"token id": bias}`` → ``(token ids, additive biases)``, in the object's order.

    A key is a token id in canonical decimal (``"42"``, not ``"042"``, ``"+42"`` nor ``" 42"``: two spellings of one
    token would be ambiguous) below ``vocab_size`` (None: unchecked); a bias a number in [-100, 100], and the bounds
    become ``±LOGIT_BIAS_HARD`` (a ban / an exclusive choice). At most ``MAX_LOGIT_BIAS_ENTRIES`` entries.
    Raises ``InvalidRequestError`` (400, ``param`` ``logit_bias``) naming the bad key or value.
    """
    if not isinstance(raw, dict):
        raise InvalidRequestError(
            f'logit_bias must be an object {{"token id": bias}}, got {type(raw).__name__}', "logit_bias"
        )
    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(raw)}", "logit_bias"
        )
    ids: list[int] = []
    biases: list[float] = []
    for key, value in raw.items():
        # Length first: int() refuses text of over 4300 digits with a ValueError (a 500 if it got that far).
        if not (
            isinstance(key, str) and 0 < len(key) <= 20 and key.isascii() and key.isdigit() and str(int(key)) == key
        ):
            raise InvalidRequestError(
                f'logit_bias keys must be token ids in decimal (such as "42"), got {key!r}', "logit_bias"
            )
        tid = int(key)
        if vocab_size is not None and tid >= vocab_size:
            raise InvalidRequestError(
                f"logit_bias names token {tid}, outside the vocabulary [0, {vocab_size})", "logit_bias"
            )
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or not -LOGIT_BIAS_BOUND <= value <= LOGIT_BIAS_BOUND
        ):
            raise InvalidRequestError(
                f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}", "logit_bias"
            )
        ids.append(tid)
        bias = float(value)
        biases.append(math.copysign(LOGIT_BIAS_HARD, bias) if abs(bias) == LOGIT_BIAS_BOUND else bias)
    return ids, biases


@dataclass
class GenerateRequest:
    """One tokenized generation request handed to the scheduler.

    ``input_ids``: prompt token ids ``[prompt_len]``. ``sampling_params.n`` samples share one prefill of the prompt.
    ``sampling_params.max_new_tokens`` is resolved (never None) by the server before submission.

    Logprobs (docs/contracts.md, "Prompt logprobs"): ``return_logprob`` asks for the logprob of every generated
    token; ``logprob_start_len`` (a prompt position in ``[0, prompt_len)``, None = none) asks for the logprobs of the
    prompt tokens from that position on (``ReqOutput.input_token_logprobs``), independently of ``return_logprob``;
    ``top_logprobs_num`` (0 = none) is the number of top alternatives reported for both, per position.
    """

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int | None = None
    stream: bool = False
    arrival_time: float = 0.0  # time.monotonic() when the server received it (seconds)
    # The compiled constraint (engine.grammar.Grammar), set by Engine.generate from sampling_params; never by clients.
    grammar: Any = field(default=None, repr=False, compare=False)


@dataclass
class TokenLogprob:
    """Logprob (natural log) of one token under the model's raw distribution (log_softmax of the logits, before
    penalties and temperature), with the top alternatives ``(token_id, logprob)`` sorted by logprob, descending.
    Used for generated tokens and for prompt tokens (``ReqOutput.input_token_logprobs``)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class ReqOutput:
    """A delta for one sample of one request, pushed by the scheduler after a step.

    ``text`` is the newly stable text (never half a UTF-8 character, stop strings held back/trimmed); ``token_ids``
    and ``logprobs`` are the tokens generated since the previous delta. ``finish_reason`` is set on the last delta:
    ``{"type": "stop"|"length"|"abort", "matched": str|int|None}`` (abort may carry ``"message"``).

    ``input_token_logprobs`` (only when the request set ``logprob_start_len``, and only on the first delta of each
    sample; None on every other delta): one entry per prompt position ``logprob_start_len .. prompt_tokens - 1``,
    entry ``j`` the logprob of prompt token ``logprob_start_len + j`` given the tokens before it, with its
    ``top_logprobs_num`` alternatives in ``top``; the entry of position 0 is None (nothing precedes it). A sample
    aborted before its prompt was prefilled gets none.
    """

    rid: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    input_token_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
