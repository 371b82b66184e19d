"""Server-sent events as the engine and the router write them (OpenAI's streaming format): ``data: <json>`` events,
an error event carrying the OpenAI error body (the same object as an HTTP error answer), and the closing
``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

from radixserve.contracts.protocol import error_body

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event ``data: <compact JSON>\\n\\n`` (UTF-8, non-ASCII kept as is; a lone surrogate, which
    UTF-8 cannot carry, as its ``\\ud800`` escape rather than an exception that would cut the stream short)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        data = json.dumps(obj, separators=(",", ":")).encode("ascii")
    return b"data: " + data + b"\n\n"


def sse_error(message: str, status: int, param: str | None = None) -> bytes:
    """A mid-stream error event: ``error_body(message, status, param)``, i.e. ``{"error": {"message", "type", "param",
    "code"}}`` (the OpenAI SDK raises ``APIError`` on it). A stream that fails after it started sends this, then
    ``SSE_DONE``."""
    return sse(error_body(message, status, param))
