"""Incremental (streaming) detokenization that never emits half a UTF-8 character.

The surr_offset / read_offset scheme of SGLang's ``DetokenizerManager``
(``schedule_batch.Req.init_incremental_detokenize``) and vLLM's ``detokenize_incrementally``: every step decodes a short
window ``ids[surr_offset:]`` and compares it with ``ids[surr_offset:read_offset]`` (the surrounding context already
emitted). Decoding with a little left context keeps the leading space of SentencePiece / ByteLevel pieces right, and the
window stays short because both offsets advance whenever the decoded text is stable (does not end with U+FFFD, the
replacement character a decoder produces for an incomplete UTF-8 byte sequence).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """SGLang/vLLM-style incremental detokenization with surr_offset/read_offset.

    Args:
        tokenizer: any object with ``decode(ids, skip_special_tokens=...) -> str`` (a HF tokenizer or a
            ``tokenizers.Tokenizer``).
        skip_special_tokens: passed to every ``decode`` call.
        prompt_tail: optional last few prompt token ids used only as left context (never emitted), so the first
            output token decodes as it does after the prompt.

    Invariant: ``"".join(add_tokens(...) for each chunk) + flush() == tokenizer.decode(output_ids, ...)`` when
    ``prompt_tail`` is None (with a prompt tail, it equals the text that the output adds after the tail).
    ``add_tokens`` also emits the stable part before a trailing incomplete character when a chunk has several tokens.
    The invariant is exact for ByteLevel decoders (GPT-2 style, the demo model) on any ids, and for ByteFallback
    (SentencePiece ``<0xNN>``) decoders when the byte tokens form valid UTF-8: an *invalid* byte run makes
    ByteFallback turn every byte of the run into U+FFFD, including bytes already streamed as text.

    Attributes:
        output_text: all text returned so far by ``add_tokens`` and ``flush``.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, prompt_tail: list[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_tail or [])
        # ids[surr_offset:read_offset] is context whose text was already emitted; ids[read_offset:] is not yet final.
        self.surr_offset = 0
        self.read_offset = len(self.ids)
        self._surr_text = self._decode(self.surr_offset, self.read_offset)
        # Characters of the current window's new text already emitted (the stable part before a trailing U+FFFD).
        self._emitted_in_window = 0
        self.output_text = ""

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self.ids[start:end]
        if not ids:
            return ""
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return text

    def _window_delta(self) -> str:
        """Text of ``ids[surr_offset:]`` beyond the context ``ids[surr_offset:read_offset]``."""
        # The context is a prefix of the window's text for ByteLevel and SentencePiece decoders (they decode each
        # piece independently and only touch the window's first piece); cut by length, as vLLM does.
        return self._decode(self.surr_offset)[len(self._surr_text) :]

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append generated token ids; return the newly stable text (possibly empty).

        Text is held back while the decoded window ends with U+FFFD (an incomplete UTF-8 sequence that a later
        byte-fallback / ByteLevel token may complete).
        """
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        delta = self._window_delta()
        if delta and not delta.endswith(REPLACEMENT_CHAR):
            out = delta[self._emitted_in_window :]
            self.surr_offset = self.read_offset
            self.read_offset = len(self.ids)
            self._surr_text = self._decode(self.surr_offset, self.read_offset)
            self._emitted_in_window = 0
        else:
            # Everything before the trailing replacement characters is final: UTF-8 is self-synchronising, so later
            # bytes can only change the incomplete sequence at the end.
            stable = delta.rstrip(REPLACEMENT_CHAR)
            out = stable[self._emitted_in_window :]
            self._emitted_in_window = max(self._emitted_in_window, len(stable))
        self.output_text += out
        return out

    def flush(self) -> str:
        """Return whatever is held back (e.g. a trailing invalid byte sequence) at the end of generation."""
        delta = self._window_delta()
        out = delta[self._emitted_in_window :]
        self.surr_offset = self.read_offset = len(self.ids)
        self._surr_text = ""
        self._emitted_in_window = 0
        self.output_text += out
        return out
