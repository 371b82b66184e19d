"""Small pieces every endpoint uses: tokenizing client text, the max-tokens rule, request ids, finish reasons."""

from __future__ import annotations

from typing import Any, TypeGuard

from starlette.types import Scope

from radixserve.contracts.edge import REQUEST_ID_SCOPE_KEY
from radixserve.contracts.protocol import random_id
from radixserve.engine.io_struct import InvalidRequestError


def check_unicode(text: str, param: str) -> None:
    """Raise InvalidRequestError (400, naming ``param``) for text that is not valid Unicode: lone surrogates, which
    JSON can carry as ``\\ud800`` but neither the tokenizer nor a UTF-8 response can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{param} is not valid Unicode: {e.reason} at position {e.start}", param) from e


def encode_text(tokenizer: Any, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenize client text. Raises InvalidRequestError (400) for text that is not valid Unicode (``check_unicode``)."""
    check_unicode(text, param)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return ids


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


def openai_finish_reason(fr: dict[str, Any] | None) -> str | None:
    """Native finish reason → OpenAI's string (``stop``, ``length``; ``abort`` is passed through)."""
    return None if fr is None else str(fr.get("type"))


def abort_error(fr: dict[str, Any]) -> InvalidRequestError:
    """The error to report for a request the engine aborted on its own (shutdown, out of memory, ...)."""
    status = int(fr.get("status_code") or 503)
    return InvalidRequestError(str(fr.get("message") or "the request was aborted by the engine"), None, status)


def is_abort(fr: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """Whether a finish reason is the engine's own abort (shutdown, out of memory, ...)."""
    return fr is not None and fr.get("type") == "abort"


def request_id_of(scope: Scope) -> str:
    """The request id the middleware assigned (propagated ``x-request-id`` or a fresh one)."""
    return scope.get(REQUEST_ID_SCOPE_KEY) or random_id()


def chat_id(rid: str) -> str:
    return f"chatcmpl-{rid}"


def completion_id(rid: str) -> str:
    return f"cmpl-{rid}"
