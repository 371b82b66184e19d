"""Prefix keys: a request's prompt as the engine will cache it, cut into blocks and chain-hashed.

With the model's tokenizer (rebuilt from the engine's ``/get_tokenizer_files``, see ``router/tokenizer.py``) the prompt
is rendered exactly as the engine renders it (chat template, then token ids), so block ``i`` names the same tokens the
engine's radix cache holds. Without one, the rendered text is cut into character blocks (as GIE's prefix scorer and
SGLang's router do with raw text). Block hashes are chained (vLLM's prefix-caching block hash; GIE's prefix scorer):
``h_0 = H(namespace)``, ``h_i = H(h_{i-1} || block_i)``, so one 64-bit hash names a whole prefix.
"""

from __future__ import annotations

from typing import Any, Literal

from radixserve.contracts.block_hash import as_int as _as_int
from radixserve.contracts.block_hash import chain_packed, namespace_digest, pack_token_ids
from radixserve.contracts.block_hash import digest as _digest
from radixserve.router.types import PrefixKey, RequestKind

# The engine's roles (engine/server/chat.py); anything else it answers with 400, so no key.
_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def _flatten_content(content: Any) -> str | None:
    """A message's content as the engine flattens it (text parts joined by "\\n"); None where the engine answers 400."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            return None  # non-text parts and malformed text parts are 400 at the engine
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_messages(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``body["messages"]`` normalized as engine/server/chat.py ``render_prompt`` does: role "developer" -> "system",
    content flattened, ``name`` kept. None for anything the engine rejects."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        return None
    messages: list[dict[str, Any]] = []
    for m in raw:
        if not isinstance(m, dict):
            return None
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            return None
        content = _flatten_content(m.get("content"))
        if content is None:
            return None
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                return None
            msg["name"] = name
        messages.append(msg)
    return messages


def _chars_chat(messages: list[dict[str, Any]]) -> str:
    """A deterministic text rendering of chat messages for character keys (the engine's template is unknown here).
    Turn n's rendering is a prefix of turn n+1's, as with real chat templates."""
    parts = []
    for m in messages:
        name = f":{m['name']}" if "name" in m else ""
        parts.append(f"<|{m['role']}{name}|>\n{m['content']}\n")
    return "".join(parts)


def _truncate_messages(messages: list[dict[str, Any]], max_chars: int) -> tuple[list[dict[str, Any]], int]:
    """``messages`` with at most ``max_chars`` characters of content in all (in order: the last kept message is cut,
    later ones dropped), and how many content characters were cut. A chat template renders messages in order, so the
    rendering of the kept part is a prefix of the full rendering up to the cut."""
    total = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    if total <= max_chars:
        return messages, 0
    kept: list[dict[str, Any]] = []
    budget = max_chars
    for m in messages:
        content = m.get("content")
        if budget <= 0:
            break
        if isinstance(content, str) and len(content) > budget:
            m = {**m, "content": content[:budget]}
        kept.append(m)
        budget -= len(m["content"]) if isinstance(m.get("content"), str) else 0
    return kept, total - sum(len(m["content"]) for m in kept if isinstance(m.get("content"), str))


class PrefixKeyExtractor:
    """Computes a request's ``PrefixKey`` (see ``router/types.py``) from its JSON body.

    ``block_tokens``: tokens per block (token keys); ``block_chars``: characters per block when the router has no
    tokenizer for the model (then ``block_tokens`` is estimated as ``block_chars // 4``); ``prefix_blocks``: K, the
    blocks the ring routing key covers (a shorter prompt's key covers all of it); ``max_blocks``: at most this many
    blocks are hashed (longer prompts keep their first ``max_blocks``). Costs one chat-template render, one
    ``encode`` and one 8-byte blake2b per block.
    """

    def __init__(self, block_tokens: int = 16, block_chars: int = 64, prefix_blocks: int = 8, max_blocks: int = 512):
        if min(block_tokens, block_chars, prefix_blocks, max_blocks) < 1:
            raise ValueError("block_tokens, block_chars, prefix_blocks and max_blocks must be >= 1")
        self.block_tokens = block_tokens
        self.block_chars = block_chars
        self.prefix_blocks = prefix_blocks
        self.max_blocks = max_blocks
        # Text past this many characters is not rendered or tokenized (8 characters per token is generous, so the
        # first max_blocks blocks still come from real tokens); its tokens are estimated from the tokenized part.
        # Regression: 7.5 MB prompts were tokenized in full (39 s, 2 GB RSS, a stalled event loop).
        self.max_chars = max_blocks * block_tokens * 8
        self._tokenizers: dict[str, Any] = {}

    def set_tokenizer(self, model: str, tokenizer: Any) -> None:
        """Key ``model``'s requests on token blocks from now on (``tokenizer`` is a Hugging Face tokenizer)."""
        self._tokenizers[model] = tokenizer

    def has_tokenizer(self, model: str) -> bool:
        """Whether ``model``'s requests are keyed on tokens (else on characters)."""
        return model in self._tokenizers

    def extract(self, endpoint: RequestKind, body: dict[str, Any], model: str) -> PrefixKey | None:
        """The prefix key of a request to ``endpoint`` ("chat" = /v1/chat/completions, "completions" =
        /v1/completions, "generate" = native /generate) for ``model``.

        Renders the prompt as the engine does (chat: template with ``add_generation_prompt=True`` then
        ``encode(add_special_tokens=False)``; completions / generate text: ``encode`` with special tokens; token-id
        prompts as given; batches: the first prompt). Returns None, never raises, for a body the engine would reject
        (it answers 400 itself).
        """
        if not isinstance(body, dict) or not isinstance(model, str):
            return None  # type: ignore[unreachable]  # defensive: untyped callers get None, never an exception
        salt = body.get("cache_salt")
        tokenizer = self._tokenizers.get(model)
        if endpoint == "chat":
            messages = _chat_messages(body)
            if messages is None:
                return None
            if tokenizer is None:
                return self._chars_key(_chars_chat(messages), model, salt)
            if getattr(tokenizer, "chat_template", None) is None:
                return None  # the engine refuses chat for a model without a template
            messages, dropped_chars = _truncate_messages(messages, self.max_chars)
            try:
                prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception:  # noqa: BLE001 - a template refusing these messages is the engine's 400
                return None
            if not isinstance(prompt, str):
                return None
            return self._text_key(prompt, model, salt, tokenizer, add_special_tokens=False, extra_chars=dropped_chars)
        if endpoint == "completions":
            return self._prompt_key(body.get("prompt"), model, salt, tokenizer)
        text, ids = body.get("text"), body.get("input_ids")  # generate
        if (text is None) == (ids is None):
            return None  # the engine wants exactly one of them
        return self._prompt_key(text if text is not None else ids, model, salt, tokenizer, ids_only=text is None)

    # ------------------------------------------------------------------------------------------------ prompt forms

    def _prompt_key(
        self, prompt: Any, model: str, salt: Any, tokenizer: Any, ids_only: bool = False
    ) -> PrefixKey | None:
        """A completions ``prompt`` / generate ``text`` or ``input_ids``: a string, token ids, or a batch of either
        (keyed on its first element)."""
        if isinstance(prompt, str) and not ids_only:
            if tokenizer is None:
                return self._chars_key(prompt, model, salt)
            return self._text_key(prompt, model, salt, tokenizer, add_special_tokens=True)
        if not isinstance(prompt, list) or not prompt:
            return None
        first = prompt[0]
        if isinstance(first, int):
            return self._ids_key(prompt, model, salt)
        if isinstance(first, list):
            return self._ids_key(first, model, salt) if first else None
        if isinstance(first, str) and not ids_only:
            return self._prompt_key(first, model, salt, tokenizer)
        return None

    def _text_key(
        self, text: str, model: str, salt: Any, tokenizer: Any, add_special_tokens: bool, extra_chars: int = 0
    ) -> PrefixKey | None:
        """Token blocks of ``text`` (its first ``max_chars`` characters; the rest, and ``extra_chars`` characters cut
        off before rendering, count in ``prompt_tokens`` at the tokenized part's tokens per character)."""
        try:
            text.encode("utf-8")  # lone surrogates: the engine answers 400
            if len(text) > self.max_chars:
                extra_chars += len(text) - self.max_chars
                text = text[: self.max_chars]
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is not None:  # the same ids without transformers' per-call wrapper (~30 us of ~75 us)
                ids = backend.encode(text, add_special_tokens=add_special_tokens).ids
            else:
                ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception:  # noqa: BLE001 - a tokenizer error on client text is the engine's 400
            return None
        # The cut-off text is estimated at the tokens per character of the part that was tokenized.
        extra_tokens = round(extra_chars * len(ids) / len(text)) if extra_chars and text else 0
        return self._ids_key(ids, model, salt, estimated_extra_tokens=extra_tokens)

    # ------------------------------------------------------------------------------------------------ hashing

    def _namespace(self, kind: str, model: str, salt: Any) -> bytes | None:
        """``h_0``: model, cache salt and key kind, JSON-encoded so no two namespaces share bytes (None for a
        cache_salt JSON cannot carry: not from a real client). ``contracts/block_hash.py``, shared with the engine."""
        return namespace_digest(kind, model, salt)

    def _key(
        self,
        kind: Literal["tokens", "chars"],
        model: str,
        blocks: list[int],
        last: bytes,
        tail: bytes,
        prompt_tokens: int,
        block_tokens: int,
    ) -> PrefixKey:
        """The key of a prompt whose full blocks hash to ``blocks`` (``last``: the chained digest after them, ``h_0``
        for none) and whose next, partial block is ``tail`` (the bytes hashed per block; empty when none)."""
        if len(blocks) >= self.prefix_blocks:
            routing_key = blocks[self.prefix_blocks - 1]
        elif tail:
            # Shorter than K blocks: the key covers the partial block too, so short prompts spread over the ring
            # (regression: every prompt under one block had the namespace as its key and went to one engine).
            routing_key = _as_int(_digest(last + tail))
        else:
            routing_key = _as_int(last)
        return PrefixKey(model, kind, tuple(blocks), routing_key, prompt_tokens, block_tokens)

    def _ids_key(self, ids: list[Any], model: str, salt: Any, estimated_extra_tokens: int = 0) -> PrefixKey | None:
        """Token blocks of ``block_tokens`` ids, packed as uint32 so one blake2b call hashes a block."""
        h0 = self._namespace("tokens", model, salt)
        if h0 is None:
            return None
        bt = self.block_tokens
        n_full = min(len(ids) // bt, self.max_blocks)
        try:
            buf = pack_token_ids(ids)  # little-endian on every router replica
        except (TypeError, OverflowError):
            return None  # not token ids (engine 400)
        step = 4 * bt
        blocks, prev = chain_packed(h0, buf, bt, n_full)
        tail = buf[n_full * step : (n_full + 1) * step]
        return self._key("tokens", model, blocks, prev, tail, len(ids) + estimated_extra_tokens, bt)

    def _chars_key(self, text: str, model: str, salt: Any) -> PrefixKey | None:
        """Character blocks of ``block_chars`` characters; tokens estimated at 4 characters each."""
        h0 = self._namespace("chars", model, salt)
        if h0 is None:
            return None
        bc = self.block_chars
        n_full = min(len(text) // bc, self.max_blocks)
        try:
            text.encode("utf-8")  # lone surrogates: the engine answers 400
        except UnicodeEncodeError:
            return None
        prev, blocks = h0, []
        for off in range(0, n_full * bc, bc):
            prev = _digest(prev + text[off : off + bc].encode("utf-8"))
            blocks.append(_as_int(prev))
        tail = text[n_full * bc : (n_full + 1) * bc].encode("utf-8")
        return self._key("chars", model, blocks, prev, tail, (len(text) + 3) // 4, max(1, bc // 4))
