"""Token logprobs in the three wire shapes: OpenAI chat's, OpenAI legacy completions', SGLang's native.

Logprobs are natural logs (<= 0) under the model's raw distribution; ``TokenLogprob.top`` is sorted, most likely
first, and a request's ``k`` keeps its first ``k``.
"""

from __future__ import annotations

from typing import Any

from radixserve.contracts.protocol import ChatLogprobEntry, ChatLogprobs, ChatLogprobTop, CompletionLogprobs
from radixserve.engine.io_struct import TokenLogprob
from radixserve.engine.server.token_text import TextOffsets, TokenTexts


def chat_logprobs(texts: TokenTexts, lps: list[TokenLogprob], k: int) -> ChatLogprobs:
    """OpenAI chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [k entries]}]}``."""
    content = []
    for lp in lps:
        text, raw = texts.get(lp.token_id)
        top = [ChatLogprobTop(token=texts.get(t)[0], logprob=v, bytes=texts.get(t)[1]) for t, v in lp.top[:k]]
        content.append(ChatLogprobEntry(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


def legacy_logprobs(
    texts: TokenTexts,
    lps: list[TokenLogprob],
    k: int,
    offsets: TextOffsets,
    prompt_ids: list[int] | None = None,
    prompt_lps: list[TokenLogprob | None] | None = None,
) -> CompletionLogprobs:
    """Legacy completions ``logprobs`` (parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``) for ``prompt_ids`` (echo) then ``lps`` (generated tokens).

    ``prompt_lps``: the prompt tokens' logprobs, one per prompt token (the engine's ``input_token_logprobs`` from
    position 0); an entry None (the first token: nothing precedes it), or all of them when ``prompt_lps`` is None,
    shows as null. ``offsets`` tracks where the next token starts in the choice's text (advanced here; kept across
    the chunks of a stream). ``top_logprobs`` holds the top ``k`` alternatives plus the token itself (OpenAI: up to
    ``k + 1``); tokens that are not whole UTF-8 characters are shown as ``bytes:\\xNN...``.
    """
    out = CompletionLogprobs()

    def add(token_id: int, lp: TokenLogprob | None, in_prompt: bool) -> None:
        text = texts.legacy(token_id)
        out.tokens.append(text)
        out.text_offset.append(offsets.advance(token_id, in_prompt=in_prompt))
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            return
        top: dict[str, float] = {}
        for t, v in lp.top[:k]:
            top.setdefault(texts.legacy(t), v)
        top.setdefault(text, lp.logprob)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(top)

    for i, t in enumerate(prompt_ids or []):
        add(t, prompt_lps[i] if prompt_lps is not None and i < len(prompt_lps) else None, True)
    for lp in lps:
        add(lp.token_id, lp, False)
    return out


def native_output_logprobs(texts: TokenTexts, lps: list[TokenLogprob], k: int, with_text: bool) -> dict[str, Any]:
    """SGLang's ``output_token_logprobs`` ``[[logprob, id, text|null]]`` and ``output_top_logprobs`` (``k`` such
    entries per token)."""

    def entry(t: int, v: float) -> list[Any]:
        return [v, t, texts.text(t) if with_text else None]

    return {
        "output_token_logprobs": [entry(lp.token_id, lp.logprob) for lp in lps],
        "output_top_logprobs": [[entry(t, v) for t, v in lp.top[:k]] for lp in lps],
    }


def native_input_logprobs(
    texts: TokenTexts,
    input_ids: list[int],
    start: int,
    lps: list[TokenLogprob | None],
    k: int,
    with_text: bool,
) -> dict[str, Any]:
    """SGLang's ``input_token_logprobs`` ``[[logprob | null, id, text | null]]`` (one per prompt position from
    ``start``; null for position 0, nothing precedes it) and ``input_top_logprobs`` (per position ``k`` entries
    ``[logprob, id, text | null]``, null for position 0). ``lps``: the engine's ``input_token_logprobs``."""

    def entry(t: int, v: float | None) -> list[Any]:
        return [v, t, texts.text(t) if with_text else None]

    return {
        "input_token_logprobs": [
            entry(input_ids[start + j], None) if lp is None else entry(lp.token_id, lp.logprob)
            for j, lp in enumerate(lps)
        ],
        "input_top_logprobs": [None if lp is None else [entry(t, v) for t, v in lp.top[:k]] for lp in lps],
    }
