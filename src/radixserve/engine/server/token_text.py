"""The texts and bytes of single tokens, and where they start in decoded text: what logprobs show per token.

``TokenTexts`` gives a token's text and exact UTF-8 bytes (OpenAI's ``token`` / ``bytes``, SGLang's logprob text);
``TextOffsets`` the character offset of each token in the text a run of tokens decodes to (legacy completions
``text_offset``).
"""

from __future__ import annotations

import codecs
import json
from typing import Any


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
