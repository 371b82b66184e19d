"""Stop-string matching over streamed text, holding back anything that may still become a stop string.

Which stop wins: generation stops as soon as any stop string is complete, so the match is the occurrence that *ends*
first in the full text; among occurrences ending at the same character, the longest one (the earliest start) wins.
This rule does not depend on how the text was split into chunks (tokens), unlike "earliest start", which would need
text generated after a completed stop. The emitted text is ``full[:start]`` (or ``full[:end]`` with
``trim=False``, SGLang's ``no_stop_trim``). vLLM's ``StopChecker`` and SGLang's ``Req.check_finished`` search each
new piece of text the same way; holding back a suffix that is a prefix of a stop string follows vLLM's streaming
detokenizer and the OpenAI API's behaviour (a stop string never appears in a stream).
"""

from __future__ import annotations


class StopStringMatcher:
    """Holds back text that may be the start of a stop string, so no stop string (or a prefix of one that later
    completes) ever reaches a stream, even when it is split across tokens.

    Args:
        stops: stop strings; empty strings are ignored.
        trim: True removes the stop string from the output; False (``no_stop_trim``) includes it.

    Held-back text is at most ``max(len(stop)) - 1`` characters.
    """

    def __init__(self, stops: list[str], trim: bool = True):
        self.stops = sorted({s for s in stops if s}, key=len, reverse=True)
        self.trim = trim
        self._held = ""
        self.matched: str | None = None

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = min(len(text), max((len(s) for s in self.stops), default=1) - 1)
        for k in range(longest, 0, -1):
            tail = text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stops):
                return k
        return 0

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add newly generated text.

        Returns:
            ``(text safe to emit now, matched stop string or None)``. After a match the caller stops feeding; text
            after the stop string is dropped.

        Raises:
            RuntimeError: when called again after a stop string matched.
        """
        if self.matched is not None:
            raise RuntimeError("StopStringMatcher.feed called after a stop string matched")
        if not self.stops:
            return text, None
        buf = self._held + text
        # Earlier text held no complete stop, so any occurrence ends inside the new text; pick the earliest end,
        # then the longest (self.stops is sorted longest first, so a strict < keeps the longest on ties).
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            start = buf.find(s)
            if start >= 0 and (best is None or start + len(s) < best[0]):
                best = (start + len(s), start, s)
        if best is not None:
            end, start, s = best
            self.matched = s
            self._held = ""
            return buf[: start if self.trim else end], s
        hold = self._hold_length(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """Return the held-back text when generation ends for another reason (EOS, length, abort)."""
        out, self._held = self._held, ""
        return out
