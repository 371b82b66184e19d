"""Reading the engine's ``cached_tokens`` from parsed answers, and hiding the usage chunk the router asked for.

The router compares what it predicted an engine caches with what the engine says it hit: an OpenAI answer's
``usage.prompt_tokens_details.cached_tokens`` (the last chunk of a stream, asked for with
``stream_options.include_usage``) and a native ``/generate`` answer's ``meta_info.cached_tokens`` (every result,
every streamed chunk). Only JSON that mentions ``cached_tokens`` is parsed, once per SSE event.
"""

from __future__ import annotations

import json
from typing import Any

_MARK = b'"cached_tokens"'


def cached_tokens_of(answer: Any) -> dict[int, int]:
    """Cached prompt tokens by result index in one parsed answer (an OpenAI response or chunk, a native result or
    a list of them, a native chunk with its ``index``); {} when it reports none."""
    if isinstance(answer, list):
        out: dict[int, int] = {}
        for i, item in enumerate(answer):
            for cached in cached_tokens_of(item).values():
                out[i] = cached
        return out
    if not isinstance(answer, dict):
        return {}
    usage = answer.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        found = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        return {} if found is None else {0: found}
    meta = answer.get("meta_info")
    if isinstance(meta, dict):
        found = _count(meta.get("cached_tokens"))
        index = answer.get("index", 0)
        return {} if found is None else {index if isinstance(index, int) else 0: found}
    return {}


def cached_tokens_in_body(body: bytes) -> int:
    """Total cached prompt tokens a whole (non-streamed) JSON answer reports; 0 when none or not JSON."""
    if _MARK not in body:
        return 0
    try:
        answer = json.loads(body)
    except ValueError:
        return 0
    return sum(cached_tokens_of(answer).values())


class StreamUsage:
    """Follows one SSE stream's complete events: the cached tokens its chunks report (the latest per result index)
    and, with ``strip``, the stream minus the usage chunk and the ``"usage":null`` fields the router caused."""

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self._cached: dict[int, int] = {}

    @property
    def cached_tokens(self) -> int:
        """Cached prompt tokens over all results so far."""
        return sum(self._cached.values())

    def events(self, complete: bytes) -> bytes:
        """Read ``complete`` (whole events, each ending in a blank line) and return what the client gets of them:
        the same bytes, or with ``strip`` the usage-only chunk (``choices: []``) dropped."""
        if self.strip:
            # The engine adds "usage":null as the last key of every chunk once usage is asked for; drop it so the
            # client gets the same bytes as without include_usage.
            complete = complete.replace(b',"usage":null}\n\n', b"}\n\n")
            if b'"usage"' not in complete:
                return complete
        elif _MARK not in complete:
            return complete
        kept = []
        for event in complete.split(b"\n\n")[:-1]:
            kept.append(event)
            if not event.startswith(b"data: ") or (_MARK not in event and b'"usage"' not in event):
                continue
            try:
                chunk = json.loads(event[6:])
            except ValueError:
                continue
            self._cached.update(cached_tokens_of(chunk))
            if not self.strip or not isinstance(chunk, dict) or "usage" not in chunk:
                continue
            usage = chunk["usage"]
            if isinstance(usage, dict) and chunk.get("choices") == []:
                kept.pop()  # the usage-only chunk the client did not ask for
            elif usage is None:  # not our engine's compact form (another server, or spaces)
                del chunk["usage"]
                kept[-1] = b"data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False).encode()
        if not self.strip:
            return complete
        return b"".join(e + b"\n\n" for e in kept)


def _count(value: Any) -> int | None:
    """``value`` when it is a token count (an int >= 0), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
