"""One proxied request, parsed once: its JSON body, model, output-token cost and the bytes sent upstream.

``parse_request`` runs first on every ``POST`` the proxy serves. It answers with a ``RequestError`` for what the
engine itself would refuse (not a JSON object, no JSON ``Content-Type``, a bad or unknown ``model``) so such a
request never takes an engine slot, and with a ``ProxiedRequest`` otherwise. Nothing later parses the body again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from radixserve.contracts.json_body import CONTENT_TYPE_MESSAGE, is_json_content_type, parse_json_object
from radixserve.router.types import RequestKind


@dataclass(frozen=True)
class RequestError:
    """A request the router answers itself. ``status`` 400 / 404, or 503 when no engine serves any model (the
    proxy words that one from the pool's state, ``message`` is then empty); ``param`` names the field at fault."""

    status: int
    message: str
    param: str | None = None


@dataclass(frozen=True)
class ProxiedRequest:
    """A request to forward. ``body`` is the client's JSON object; ``content`` the bytes sent to the engine (the
    client's own bytes, or re-encoded when ``strip_usage``: the router asked a stream for its usage chunk, to read
    ``cached_tokens``, and hides that chunk from the client). ``out_tokens`` is what it may generate (tokens)."""

    kind: RequestKind
    body: dict[str, Any]
    model: str
    stream: bool
    out_tokens: int
    content: bytes
    strip_usage: bool


def parse_request(
    kind: RequestKind, raw: bytes, content_type: str | None, served: frozenset[str], default_max_tokens: int
) -> ProxiedRequest | RequestError:
    """Parse ``raw`` (the request body) for ``kind``. ``served``: the models some engine serves;
    ``default_max_tokens`` counts a request without max tokens. Never raises."""
    body = parse_json_object(raw)
    if isinstance(body, str):
        return RequestError(400, body)
    if not is_json_content_type(content_type):
        # The engine's 400 for a JSON object it will not read as JSON (regression: `curl -d` bodies, form-encoded,
        # got 200 through the router, as it sends the engine application/json whatever the client sent).
        return RequestError(400, CONTENT_TYPE_MESSAGE)
    model = resolve_model(body, served)
    if isinstance(model, RequestError):
        return model
    stream = body.get("stream") is True
    content, strip_usage = raw, False
    if stream and kind != "generate":
        content, strip_usage = _ask_for_usage(body, raw)
    return ProxiedRequest(
        kind, body, model, stream, output_token_cost(kind, body, default_max_tokens), content, strip_usage
    )


def resolve_model(body: dict[str, Any], served: frozenset[str]) -> str | RequestError:
    """The model ``body`` asks for (the only one served when it names none), or why not (503: none served)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return RequestError(400, "model must be a string", "model")
    if not served:
        return RequestError(503, "")
    if model is None:
        if len(served) == 1:
            return next(iter(served))
        return RequestError(400, f"model is required: this router serves {', '.join(sorted(served))}", "model")
    if model not in served:
        return RequestError(404, f"The model `{model}` does not exist.", "model")
    return model


# Counts above this are malformed (no context is that long): they count as their defaults. Regression: ``"n": 1e400``
# written as an integer made the cost too large for the policy's float load arithmetic (OverflowError -> 500).
_MAX_COUNT = 2**31


def output_token_cost(kind: RequestKind, body: dict[str, Any], default_max_tokens: int) -> int:
    """Tokens this request may generate: max tokens (or ``default_max_tokens``) x samples (``n``, or a completion's
    ``best_of`` when larger: each candidate is generated) x prompts. Malformed
    fields (the wrong type, negative, or ``_MAX_COUNT`` and over) count as their defaults (the engine answers 400
    for them)."""
    n: object = 1
    mt: object
    prompts = 1
    if kind == "generate":
        sp = body.get("sampling_params")
        if isinstance(sp, list):
            sp = sp[0] if sp and isinstance(sp[0], dict) else None
        mt = sp.get("max_new_tokens") if isinstance(sp, dict) else None
        if isinstance(sp, dict):
            n = sp.get("n", 1)
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, list):
            prompts = len(text)
        elif isinstance(ids, list) and ids and isinstance(ids[0], list):
            prompts = len(ids)
    else:
        mt = body.get("max_completion_tokens")
        if mt is None:
            mt = body.get("max_tokens")
        n = body.get("n", 1)
        best_of = body.get("best_of")  # completions: best_of candidates are generated, n of them returned
        if type(best_of) is int and type(n) is int and n < best_of < _MAX_COUNT:
            n = best_of
    if not isinstance(mt, int) or isinstance(mt, bool) or not 0 <= mt < _MAX_COUNT:
        mt = default_max_tokens
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n < _MAX_COUNT:
        n = 1
    return mt * n * max(prompts, 1)


def _ask_for_usage(body: dict[str, Any], raw: bytes) -> tuple[bytes, bool]:
    """An OpenAI stream's upstream bytes with ``stream_options.include_usage`` on, and whether the router added it
    (then the usage chunk is the router's, stripped from the client's stream)."""
    so = body.get("stream_options")
    # The engine reads include_usage strictly (true / false only): a malformed stream_options, or a flag such as
    # "false" or 1, is left for the engine to refuse (400), never overwritten.
    # Absent, null (its default) or false: off (identity, not ==: 0 is not false to the engine).
    off = isinstance(so, dict) and (so.get("include_usage") is None or so.get("include_usage") is False)
    if not (so is None or off):
        return raw, False
    upstream = {**body, "stream_options": {**(so or {}), "include_usage": True}}
    # ensure_ascii: a lone surrogate (valid JSON escape, not encodable UTF-8) reaches the engine as the escape it
    # came in as, and the engine answers 400 (regression: UnicodeEncodeError -> 500).
    return json.dumps(upstream).encode(), True
