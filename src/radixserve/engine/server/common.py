"""Pieces shared by the native and OpenAI endpoints: server context, request ids, token texts, limits, SSE framing."""

from __future__ import annotations

import codecs
import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.contracts import constants
from radixserve.contracts.edge import REQUEST_ID_SCOPE_KEY
from radixserve.contracts.protocol import random_id
from radixserve.engine.io_struct import InvalidRequestError, ReqOutput, TokenLogprob

if TYPE_CHECKING:  # pragma: no cover
    from radixserve.engine.engine import Engine

logger = logging.getLogger("radixserve.engine.server")


def encode_text(tokenizer: Any, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenize client text. Raises InvalidRequestError (400) for text that is not valid Unicode (lone surrogates,
    which JSON can carry as ``\\ud800`` but the tokenizer rejects)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{param} is not valid Unicode: {e.reason} at position {e.start}", param) from e
    ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return ids


class RidRegistry:
    """Engine request ids in flight on this server, so a client reusing an ``x-request-id`` cannot clash in the engine.

    The HTTP event loop is single-threaded, so no lock is needed.
    """

    def __init__(self) -> None:
        self._live: set[str] = set()

    def claim(self, base: str, count: int) -> list[str]:
        """Reserve ``count`` unique engine rids derived from ``base`` (``base`` itself when ``count`` is 1)."""
        wanted = [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
        if any(r in self._live for r in wanted):
            suffix = random_id()[:8]
            wanted = [f"{r}-{suffix}" for r in wanted]
        self._live.update(wanted)
        return wanted

    def release(self, rids: list[str]) -> None:
        self._live.difference_update(rids)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable stand-in character → byte (Radford et al. 2019)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Text and exact UTF-8 bytes of single tokens, for OpenAI logprobs (``token``, ``bytes``).

    For byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM2) the bytes are the token's own bytes, which may be part of a
    multi-byte character; its ``token`` text then holds U+FFFD as OpenAI's does. Results are cached per token id.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        try:
            decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
            byte_level = decoder.get("type") == "ByteLevel"
        except Exception:  # noqa: BLE001 - slow tokenizers have no backend; fall back to decode()
            byte_level = False
        self._byte_decoder = _byte_decoder() if byte_level else None
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        if self._byte_decoder is not None and token_id not in self._special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(c in self._byte_decoder for c in piece):
                raw = bytes(self._byte_decoder[c] for c in piece)
                return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, utf8_bytes)`` of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def legacy(self, token_id: int) -> str:
        """The token as legacy completions ``logprobs.tokens`` shows it: its text, or ``bytes:\\xNN...`` (OpenAI's
        convention) when its bytes are not whole UTF-8 characters, so partial tokens stay distinct (they are keys
        of ``top_logprobs``)."""
        text, raw = self.get(token_id)
        try:
            bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text


class TextOffsets:
    """Character offsets of successive tokens in the text they decode to (legacy completions ``text_offset``).

    A token's offset is the index, in the decoded text, of the first character its bytes start or continue; the
    bytes are run through an incremental UTF-8 decoder (invalid sequences count as one U+FFFD each, as the
    tokenizer's decode does), so a character split over several byte-level tokens advances the offset once, not
    once per token. Special tokens advance nothing when ``skip_special_tokens`` (they are not in the text).
    """

    def __init__(self, texts: TokenTexts, skip_special_tokens: bool = True, start: int = 0):
        self.texts = texts
        self.skip_special_tokens = skip_special_tokens
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, token_id: int, in_prompt: bool = False) -> int:
        """The offset of ``token_id`` (appended after the previous tokens); moves past its complete characters.

        ``in_prompt``: an echoed prompt token, whose text is always shown (special tokens included)."""
        here = self.offset
        if not in_prompt and self.skip_special_tokens and self.texts.is_special(token_id):
            return here
        self.offset += len(self._decoder.decode(bytes(self.texts.get(token_id)[1])))
        return here


@dataclass
class ServerContext:
    """Everything the route handlers need, built once per app from the engine (no module-level state)."""

    engine: Engine
    texts: TokenTexts
    rids: RidRegistry = field(default_factory=RidRegistry)
    _template_caps: Any = None

    @classmethod
    def of(cls, engine: Engine) -> ServerContext:
        from radixserve.engine.server.reasoning import make_reasoning_stream

        make_reasoning_stream(getattr(engine.args, "reasoning_parser", None))  # fail at startup on an unknown name
        return cls(engine=engine, texts=TokenTexts(engine.tokenizer))

    @property
    def template_caps(self) -> Any:
        """The chat template's ``TemplateCaps`` (probed once, on first use)."""
        if self._template_caps is None:
            from radixserve.engine.server.chat import TemplateCaps

            self._template_caps = TemplateCaps.probe(self.engine.tokenizer)
        return self._template_caps

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def check_model(self, model: str | None) -> None:
        """Raise 404 unless ``model`` is None or the served model name."""
        if model is not None and model != self.model_name:
            raise InvalidRequestError(f"The model `{model}` does not exist.", "model", status_code=404)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"{param} must hold token ids in [0, {vocab})", param)


def resolve_max_tokens(
    requested: int | None, default: int | None, prompt_tokens: int, context_length: int, param: str, prompt_param: str
) -> int:
    """The number of new tokens to ask the engine for, checked against the context length.

    ``requested`` None means "not given": ``default`` clamped to the room left, or all the room when ``default`` is
    None. Raises ``InvalidRequestError`` (400) for an empty prompt, a prompt of ``context_length`` tokens or more
    (naming both numbers), a negative value, or prompt + requested over the context length (naming all three).
    """
    if prompt_tokens == 0:
        raise InvalidRequestError("the prompt must not be empty", prompt_param)
    if prompt_tokens >= context_length:
        raise InvalidRequestError(
            f"This model's maximum context length is {context_length} tokens, but the prompt has {prompt_tokens} "
            f"tokens; the prompt must be shorter than the context length.",
            prompt_param,
        )
    room = context_length - prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise InvalidRequestError(f"{param} must be an integer >= 0, got {requested!r}", param)
    if prompt_tokens + requested > context_length:
        raise InvalidRequestError(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the completion). "
            f"Please reduce the prompt or {param}.",
            param,
        )
    return requested


@dataclass
class SampleState:
    """What has been generated so far for one sample (one choice) of one request."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, out: ReqOutput) -> None:
        self.text_parts.append(out.text)
        self.token_ids.extend(out.token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, out.completion_tokens)
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def openai_finish_reason(fr: dict[str, Any] | None) -> str | None:
    """Native finish reason → OpenAI's string (``stop``, ``length``; ``abort`` is passed through)."""
    return None if fr is None else str(fr.get("type"))


def abort_error(fr: dict[str, Any]) -> InvalidRequestError:
    """The error to report for a request the engine aborted on its own (shutdown, out of memory, ...)."""
    status = int(fr.get("status_code") or 503)
    return InvalidRequestError(str(fr.get("message") or "the request was aborted by the engine"), None, status)


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response that always closes its body iterator, so an abandoned stream aborts the engine
    request even when the client vanished between two chunks."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, headers: dict[str, str] | None = None):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def request_id_of(scope: Scope) -> str:
    """The request id the middleware assigned (propagated ``x-request-id`` or a fresh one)."""
    return scope.get(REQUEST_ID_SCOPE_KEY) or random_id()


def chat_id(rid: str) -> str:
    return f"chatcmpl-{rid}"


def completion_id(rid: str) -> str:
    return f"cmpl-{rid}"


HEADER_REQUEST_ID = constants.HEADER_REQUEST_ID
