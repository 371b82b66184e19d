"""How bench/soak.py judges one answer: ``ok``, ``clean`` (a clean error) or ``bad``, with the reason.

- ``ok``: the answer a correct server gives: a 200 whose every choice finished, whose ``json_schema`` content
  validates and whose tool calls' arguments are JSON meeting the tool's parameters (a reply cut by ``length`` is not
  checked: it was asked to stop there); or, for a request meant to be refused (``Spec.expect`` ``refuse``), a 400 /
  413 error body; or an abandoned stream whose events so far were well formed.
- ``clean``: an error a client can handle: an HTTP 400 / 413 / 429 / 503 with the OpenAI error body of
  docs/contracts.md ("Errors": ``code`` = the status, ``type`` by status, ``Retry-After`` on 429 / 503), or a stream
  that ends with an SSE error event (the same body) followed by ``data: [DONE]``.
- ``bad``: anything else: another status (a 500, a 502 / 504 a retry could have avoided), a malformed body, a
  malformed SSE line, a stream cut without an error event or ``[DONE]``, content that fails its schema, invalid tool
  arguments. A hang is judged by the caller (its deadline).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from soak_mix import Spec

CLEAN_STATUSES = frozenset({400, 413, 429, 503})
REFUSED_STATUSES = frozenset({400, 413})
_TYPES = {400: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}


@dataclass(frozen=True)
class Verdict:
    """``outcome`` ``ok`` | ``clean`` | ``bad``; ``why`` in words (empty for a plain ok)."""

    outcome: str
    why: str = ""


def error_body_problem(body: Any, status: int | None) -> str | None:
    """What is wrong with an OpenAI error body (``status``: the HTTP status its ``code`` must equal; None for a
    stream's error event, whose code is any 4xx/5xx), or None when it is right."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return f"not an error body: {str(body)[:200]}"
    err = body["error"]
    if not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return f"error without a message or type: {err}"
    if "param" not in err or not (err["param"] is None or isinstance(err["param"], str)):
        return f"error param neither null nor a string: {err}"
    code = err.get("code")
    if not isinstance(code, int) or (status is not None and code != status) or not 400 <= code < 600:
        return f"error code {code!r} for status {status}: {err}"
    want = _TYPES.get(code, "invalid_request_error" if code < 500 else "server_error")
    if code in (401, 404):
        want = err["type"]  # named after the SDK's errors; not sent by this soak's requests
    if err["type"] != want:
        return f"error type {err['type']!r} for code {code}, want {want!r}"
    return None


def judge_http_error(spec: Spec, status: int, headers: dict[str, str], content: bytes) -> Verdict:
    """A non-200 answer."""
    try:
        body = json.loads(content)
    except ValueError:
        return Verdict("bad", f"HTTP {status} with a body that is not JSON: {content[:200]!r}")
    if status not in CLEAN_STATUSES:
        return Verdict("bad", f"HTTP {status}: {str(body)[:300]}")
    problem = error_body_problem(body, status)
    if problem is not None:
        return Verdict("bad", f"HTTP {status}: {problem}")
    if status in (429, 503) and "retry-after" not in headers:
        return Verdict("bad", f"HTTP {status} without Retry-After: {body['error']['message'][:200]}")
    if spec.expect == "refuse" and status in REFUSED_STATUSES:
        return Verdict("ok", f"refused {status}")
    return Verdict("clean", f"HTTP {status}: {body['error']['message'][:200]}")


def _content_problem(spec: Spec, content: str, tool_calls: list[dict[str, Any]], finish: str | None) -> str | None:
    """What is wrong with one finished choice's text and tool calls, or None."""
    if spec.schema is not None and finish == "stop":
        try:
            jsonschema.validate(json.loads(content), spec.schema)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"json_schema output {content[:200]!r} is invalid: {str(e).splitlines()[0][:200]}"
    if spec.tools and finish != "length":
        if finish != "tool_calls" or not tool_calls:
            return f"forced tool choice ended {finish!r} with {len(tool_calls)} call(s), text {content[:120]!r}"
        for call in tool_calls:
            fn = call.get("function") or {}
            name, args = fn.get("name"), fn.get("arguments")
            if name not in spec.tools:
                return f"tool call to unknown function {name!r}"
            try:
                jsonschema.validate(json.loads(args if isinstance(args, str) else ""), spec.tools[name])
            except (TypeError, ValueError, jsonschema.ValidationError) as e:
                return f"tool call {name} arguments {str(args)[:200]!r} invalid: {str(e).splitlines()[0][:200]}"
    return None


def judge_json(spec: Spec, body: Any) -> Verdict:
    """A 200 JSON answer (not streamed)."""
    if spec.expect == "refuse":
        return Verdict("bad", f"served a request that must be refused ({spec.kind})")
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or sorted(c.get("index") for c in choices) != list(range(spec.choices)):
        return Verdict("bad", f"choices are not indices 0..{spec.choices - 1}: {str(body)[:300]}")
    for c in choices:
        finish = c.get("finish_reason")
        if finish not in ("stop", "length", "tool_calls"):
            return Verdict("bad", f"choice {c.get('index')} finish_reason {finish!r}")
        message = c.get("message")
        text = message.get("content") if isinstance(message, dict) else c.get("text")
        calls = (message.get("tool_calls") if isinstance(message, dict) else None) or []
        problem = _content_problem(spec, text or "", calls, finish)
        if problem is not None:
            return Verdict("bad", problem)
    return Verdict("ok")


class SSEReader:
    """Splits an event stream's bytes into its ``data:`` payloads; records the first malformed line."""

    def __init__(self) -> None:
        self.buf = b""
        self.payloads: list[str] = []
        self.malformed: str | None = None

    def feed(self, chunk: bytes) -> int:
        """Take ``chunk``; return how many payloads are known now."""
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            text = line.rstrip(b"\r").decode("utf-8", "replace")
            if text.startswith("data: "):
                self.payloads.append(text[6:])
            elif text and not text.startswith(":") and self.malformed is None:
                self.malformed = text[:200]
        return len(self.payloads)


def judge_stream(spec: Spec, reader: SSEReader, abandoned: bool) -> Verdict:
    """A 200 event stream, read to its end (or, ``abandoned``, until the client hung up)."""
    if reader.malformed is not None:
        return Verdict("bad", f"malformed SSE line {reader.malformed!r}")
    if reader.buf.strip() and not abandoned:
        return Verdict("bad", f"stream ended inside an event: {reader.buf[:200]!r}")
    payloads = reader.payloads
    done = payloads.index("[DONE]") if "[DONE]" in payloads else -1
    if done >= 0 and done != len(payloads) - 1:
        return Verdict("bad", f"events after [DONE]: {payloads[done + 1 :][:2]}")
    if done < 0 and not abandoned:
        last = payloads[-1][:200] if payloads else "no event"
        return Verdict("bad", f"stream cut without an error event or [DONE] (last: {last})")
    events = []
    for p in payloads[: done if done >= 0 else None]:
        try:
            events.append(json.loads(p))
        except ValueError:
            return Verdict("bad", f"SSE payload is not JSON: {p[:200]!r}")
    errors = [i for i, e in enumerate(events) if isinstance(e, dict) and "error" in e]
    if errors:
        if errors != [len(events) - 1] or done < 0:
            return Verdict("bad", f"error event not last before [DONE]: {str(events[errors[0]])[:200]}")
        problem = error_body_problem(events[-1], None)
        if problem is not None:
            return Verdict("bad", f"stream error event: {problem}")
        code = events[-1]["error"]["code"]
        if spec.expect == "refuse" and code in REFUSED_STATUSES and len(events) == 1:
            return Verdict("ok", f"refused {code} in the stream")
        return Verdict("clean", f"stream error event {code}: {events[-1]['error']['message'][:200]}")
    if spec.expect == "refuse":
        return Verdict("bad", f"streamed a request that must be refused ({spec.kind})")
    if abandoned:
        return Verdict("ok", "abandoned")
    return _judge_stream_choices(spec, events)


def _judge_stream_choices(spec: Spec, events: list[Any]) -> Verdict:
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    calls: dict[int, dict[int, dict[str, Any]]] = {}  # choice -> tool call index -> {"function": {name, arguments}}
    for e in events:
        for c in e.get("choices") or []:
            i = c.get("index")
            if not isinstance(i, int) or not 0 <= i < spec.choices:
                return Verdict("bad", f"chunk with choice index {i!r}")
            delta = c.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else c.get("text")
            texts[i] = texts.get(i, "") + (piece or "")
            for tc in (delta.get("tool_calls") if isinstance(delta, dict) else None) or []:
                slot = calls.setdefault(i, {}).setdefault(tc.get("index", 0), {"function": {"arguments": ""}})
                fn = tc.get("function") or {}
                if fn.get("name"):
                    slot["function"]["name"] = fn["name"]
                slot["function"]["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason") is not None:
                if i in finishes:
                    return Verdict("bad", f"choice {i} finished twice")
                finishes[i] = c["finish_reason"]
    for i in range(spec.choices):
        finish = finishes.get(i)
        if finish not in ("stop", "length", "tool_calls"):
            return Verdict("bad", f"stream choice {i} finish_reason {finish!r}")
        problem = _content_problem(spec, texts.get(i, ""), list(calls.get(i, {}).values()), finish)
        if problem is not None:
            return Verdict("bad", problem)
    return Verdict("ok")
