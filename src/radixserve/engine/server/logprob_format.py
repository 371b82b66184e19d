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
) -> CompletionLogprobs:
    """Legacy completions ``logprobs`` (parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``) for ``prompt_ids`` (echo; logprobs unknown → null) then ``lps``.

    ``offsets`` tracks where the next token starts in the choice's text (advanced here; kept across the chunks of a
    stream). ``top_logprobs`` holds the top ``k`` alternatives plus the sampled token (OpenAI: up to ``k + 1``);
    tokens that are not whole UTF-8 characters are shown as ``bytes:\\xNN...``.
    """
    out = CompletionLogprobs()
    for t in prompt_ids or []:
        out.tokens.append(texts.legacy(t))
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
        out.text_offset.append(offsets.advance(t, in_prompt=True))
    for lp in lps:
        text = texts.legacy(lp.token_id)
        top: dict[str, float] = {}
        for t, v in lp.top[:k]:
            top.setdefault(texts.legacy(t), v)
        top.setdefault(text, lp.logprob)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offsets.advance(lp.token_id))
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
