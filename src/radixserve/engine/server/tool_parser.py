"""Tool calls out of the model's text, and ``ChatOutputParser``: one chat choice's output → reasoning, content and
tool calls, the same whether streamed or not. The call formats are described in ``tools.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from radixserve.engine.server.reasoning import ReasoningStream
from radixserve.engine.server.tools import TOOL_CALL_END, TOOL_CALL_START

_BLOCK_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|\Z)", re.S)
_FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _as_call(obj: Any, names: set[str]) -> tuple[str, str] | None:
    """``(name, arguments JSON text)`` if ``obj`` is ``{"name": <known tool>, "arguments"|"parameters": object}``."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _loads(text: str) -> Any:
    text = text.strip()
    m = _FENCE_RE.match(text)
    if m:
        text = m.group(1)
    return json.loads(text)


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Calls in a whole reply (``auto``): ``(content or None, [(name, arguments JSON text)])``.

    See the module docstring for the accepted formats. No call found: ``(text, [])``.
    """
    if TOOL_CALL_START in text:
        calls = []
        for m in _BLOCK_RE.finditer(text):
            try:
                call = _as_call(_loads(m.group(1)), names)
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        rest = _BLOCK_RE.sub("", text).strip()
        return (rest or None), calls
    stripped = text.strip()
    if stripped[:1] in ("{", "[") or stripped.startswith("```"):
        try:
            obj = _loads(stripped)
        except ValueError:
            return text, []
        objs = obj if isinstance(obj, list) and obj else [obj]
        found = [_as_call(o, names) for o in objs]
        calls = [c for c in found if c is not None]
        if len(calls) == len(found):
            return None, calls
    return text, []


def parse_forced_call(text: str, names: set[str]) -> tuple[str, str] | None:
    """The one call of a constrained reply (``required``/named), or None if it does not parse (cut by length)."""
    try:
        return _as_call(json.loads(text), names)
    except ValueError:
        return None


@dataclass
class ChoiceDelta:
    """Text released by ``ChatOutputParser``: reasoning, answer content, and (at the end) tool calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] | None = None


class ChatOutputParser:
    """Turns one choice's output deltas into reasoning, content and tool calls, the same way streamed or not.

    ``mode``: ``"text"`` (no tools: content passes through), ``"auto"`` (content streams until a possible call
    starts: ``<tool_call>``, or a reply opening with ``{``/``[``/```` ``` ````; from there it is held and parsed at
    the end), ``"forced"`` (the constrained JSON is held and parsed as one call). ``reasoning``: a
    ``ReasoningStream`` applied first (tools are parsed from the answer part only).
    """

    def __init__(self, mode: str, names: set[str], reasoning: ReasoningStream | None = None):
        self.mode, self.names, self.reasoning = mode, names, reasoning
        if mode not in ("text", "auto", "forced"):
            raise ValueError(f"unknown output mode {mode!r}")
        self.state = {"text": "plain", "auto": "begin", "forced": "forced"}[mode]  # auto: begin -> text | held
        self.pending = ""  # auto text not yet released (may start a tag)
        self.held = ""  # text of a possible call, parsed at the end
        self.content_sent = ""

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.reasoning_tokens if self.reasoning is not None else 0

    def feed(self, text: str, n_tokens: int = 0) -> ChoiceDelta:
        """One output delta of ``n_tokens`` tokens."""
        if self.reasoning is None:
            return ChoiceDelta(content=self._content(text))
        d = self.reasoning.feed(text, n_tokens)
        return ChoiceDelta(reasoning=d.reasoning, content=self._content(d.content))

    def finish(self) -> ChoiceDelta:
        """End of the choice: releases held text and the parsed calls (``calls`` None when there are none)."""
        out = ChoiceDelta()
        if self.reasoning is not None:
            d = self.reasoning.finish()
            out.reasoning = d.reasoning
            out.content = self._content(d.content)
        if self.state == "forced":
            call = parse_forced_call(self.held, self.names)
            if call is not None:
                out.calls = [call]
            else:
                out.content += self.held
            return out
        if self.state == "plain":
            return out
        tail = self.pending + self.held  # "begin" (only blank text or a partial tag seen) or "held"
        content, calls = parse_tool_calls(tail, self.names) if tail.strip() else (tail, [])
        if calls:
            out.calls = calls
            if content:
                out.content += content
        else:
            out.content += tail
        self.pending = self.held = ""
        return out

    def _content(self, text: str) -> str:
        if not text:
            return ""
        if self.state == "forced":
            self.held += text
            return ""
        if self.state == "plain":
            return text
        if self.state == "held":
            self.held += text
            return ""
        self.pending += text
        if self.state == "begin":
            head = self.pending = self.pending.lstrip()  # a reply's leading blank lines are dropped
            if not head:
                return ""
            if head[0] in "{[" or head.startswith("```") or "```".startswith(head):
                self.state, self.held, self.pending = "held", self.pending, ""
                return ""
            if TOOL_CALL_START.startswith(head) and head != TOOL_CALL_START:
                return ""
            self.state = "text"
        i = self.pending.find(TOOL_CALL_START)
        if i >= 0:
            released, self.held, self.pending = self.pending[:i], self.pending[i:], ""
            self.state = "held"
        else:
            keep = 0
            for k in range(min(len(self.pending), len(TOOL_CALL_START) - 1), 0, -1):
                if TOOL_CALL_START.startswith(self.pending[-k:]):
                    keep = k
                    break
            released, self.pending = self.pending[: len(self.pending) - keep], self.pending[len(self.pending) - keep :]
        self.content_sent += released
        return released
