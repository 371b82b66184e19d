"""Reasoning parser: split a chat model's ``<think>...</think>`` text from its answer (``--reasoning-parser think``).

After SGLang's ``srt/reasoning_parser.py`` and vLLM's ``DeepSeekR1ReasoningParser``, in the format of DeepSeek-R1 /
Qwen3 / SmolLM3 outputs: when the completion starts (after optional whitespace) with ``<think>``, everything up to
``</think>`` is reasoning (``message.reasoning_content``, ``delta.reasoning_content`` when streaming) and the rest,
without its leading whitespace, is the answer (``content``). A completion that does not start with ``<think>`` is all
answer; one cut off before ``</think>`` is all reasoning. The same state machine serves streamed and non-streamed
responses, so both split identically, and it counts the reasoning tokens for
``usage.completion_tokens_details.reasoning_tokens``: every token of a delta consumed while inside the reasoning (the
tags included) counts, so with one token per delta the count is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_PARSERS = ("think",)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper suffix of ``text`` that is a prefix of ``tag`` (text to hold back: the tag may
    be completed by the next delta)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ReasoningDelta:
    """What one ``feed`` releases: new reasoning text and new answer text (either may be empty)."""

    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Incremental ``<think>`` splitter for one sample (one choice) of one request.

    ``feed(text, n_tokens)`` with each output delta returns the reasoning and content text now safe to release
    (text that may be the start of a tag is held back); ``finish()`` releases what is held. ``reasoning_tokens``
    counts the tokens fed while inside the reasoning.
    """

    def __init__(self, start: str = "<think>", end: str = "</think>"):
        self.start_tag, self.end_tag = start, end
        self.state = "begin"  # begin -> reasoning -> after (leading whitespace of the answer) -> content
        self.buf = ""
        self.reasoning_tokens = 0
        self._pending_tokens = 0  # tokens fed before we know whether the completion starts with <think>
        self.has_reasoning = False

    def feed(self, text: str, n_tokens: int = 0) -> ReasoningDelta:
        """Consume one output delta of ``n_tokens`` tokens decoding to ``text``."""
        out = ReasoningDelta()
        if self.state in ("begin", "reasoning"):
            if self.state == "begin":
                self._pending_tokens += n_tokens
            else:
                self.reasoning_tokens += n_tokens
        self.buf += text
        self._advance(out)
        return out

    def _advance(self, out: ReasoningDelta) -> None:
        while True:
            if self.state == "begin":
                head = self.buf.lstrip()
                if head.startswith(self.start_tag):
                    self.buf = head[len(self.start_tag) :]
                    self.state, self.has_reasoning = "reasoning", True
                    self.reasoning_tokens += self._pending_tokens
                    self._pending_tokens = 0
                    continue
                if not head or self.start_tag.startswith(head):
                    return  # whitespace or a partial "<think" so far
                self.state = "content"
                self._pending_tokens = 0
                continue
            if self.state == "reasoning":
                i = self.buf.find(self.end_tag)
                if i >= 0:
                    out.reasoning += self.buf[:i]
                    self.buf = self.buf[i + len(self.end_tag) :]
                    self.state = "after"
                    continue
                keep = _partial_suffix(self.buf, self.end_tag)
                out.reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep :]
                return
            if self.state == "after":
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return
                self.state = "content"
                continue
            out.content += self.buf
            self.buf = ""
            return

    def finish(self) -> ReasoningDelta:
        """Release the held-back text at the end of the completion."""
        out = ReasoningDelta()
        if self.state == "reasoning":
            out.reasoning, self.buf = self.buf, ""
        elif self.state in ("begin", "content"):
            out.content, self.buf = self.buf, ""
        else:
            self.buf = ""
        return out


def make_reasoning_stream(name: str | None) -> ReasoningStream | None:
    """The parser for ``--reasoning-parser NAME`` (None: no parsing). Raises ``ValueError`` for an unknown name."""
    if name is None:
        return None
    if name == "think":
        return ReasoningStream("<think>", "</think>")
    raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")


def split_reasoning(text: str, name: str = "think") -> tuple[str | None, str]:
    """Split a whole completion into ``(reasoning or None, content)`` (the streaming parser, fed at once)."""
    stream = make_reasoning_stream(name)
    assert stream is not None
    a, b = stream.feed(text), stream.finish()
    reasoning = a.reasoning + b.reasoning
    return (reasoning if stream.has_reasoning else None), a.content + b.content
