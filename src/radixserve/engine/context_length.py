"""The context length an engine serves (longest prompt + completion, in tokens): where it comes from, and the checks
that make a wrong one a start-up message instead of a silent change.

- ``--context-length`` above the model's ``max_position_embeddings`` (what it was trained for) is refused, as SGLang
  refuses it (srt/configs/model_config.py: a ValueError unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``); here
  ``RADIXSERVE_ALLOW_LONGER_CONTEXT=1`` is the opt-in, and serving it then logs a WARNING.
- A KV pool smaller than the context cuts the context to the pool, with a WARNING that says so and how to fix it
  (regression: ``--context-length 100000 --max-total-tokens 20000`` served a 20000-token context without a word).
- A context too short for a one-message chat (the chat template alone takes ~30 tokens with the demo model) gets a
  WARNING: every chat request would be a 400 (regression: ``--max-total-tokens 10`` started quietly). A WARNING, not
  an error: completions of a few tokens still work, and tests run engines with pools of a few dozen tokens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ALLOW_LONGER_CONTEXT_ENV = "RADIXSERVE_ALLOW_LONGER_CONTEXT"
# The shortest chat the context-too-short warning measures: one user message, rendered with the generation prompt.
_PROBE_CHAT = [{"role": "user", "content": "Hi"}]


def longer_context_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """``RADIXSERVE_ALLOW_LONGER_CONTEXT`` is ``1`` or ``true`` (any case), as SGLang reads its boolean variables."""
    environ = os.environ if environ is None else environ
    return environ.get(ALLOW_LONGER_CONTEXT_ENV, "").strip().lower() in ("1", "true")


def check_context_length(
    requested: int | None, max_position_embeddings: int, environ: Mapping[str, str] | None = None
) -> None:
    """Refuse a ``--context-length`` (``requested``; None: not given) above ``max_position_embeddings`` unless
    ``longer_context_allowed(environ)``, in which case it is logged at WARNING.

    Raises:
        ValueError: one line naming the flag, the model's limit and the opt-in.
    """
    if requested is None or requested <= max_position_embeddings:
        return
    risk = f"outputs past {max_position_embeddings} tokens may be wrong"
    if longer_context_allowed(environ):
        logger.warning(
            "--context-length %d is longer than the model's max_position_embeddings (%d), allowed by %s=1: %s",
            requested,
            max_position_embeddings,
            ALLOW_LONGER_CONTEXT_ENV,
            risk,
        )
        return
    raise ValueError(
        f"--context-length {requested} is longer than the model's max_position_embeddings ({max_position_embeddings}),"
        f" the longest sequence it was trained for; give at most {max_position_embeddings}, or set "
        f"{ALLOW_LONGER_CONTEXT_ENV}=1 to serve it anyway ({risk})"
    )


@dataclass(frozen=True)
class ServedContext:
    """The context length served, in tokens, and where it comes from, in words (for the start-up log)."""

    tokens: int
    source: str


def served_context(
    requested: int | None, max_position_embeddings: int, pool_tokens: int, pool_rule: str
) -> ServedContext:
    """The context the engine serves: ``requested`` (``--context-length``) or the model's ``max_position_embeddings``,
    cut to the KV pool's ``pool_tokens`` when the pool is smaller (one sequence must fit in the pool), with a WARNING
    quoting ``pool_rule`` (what sized the pool) and the ways out."""
    if requested is not None:
        tokens, source = requested, "--context-length"
    else:
        tokens, source = max_position_embeddings, "the model's max_position_embeddings"
    if pool_tokens >= tokens:
        return ServedContext(tokens, source)
    logger.warning(
        "context cut from %d tokens (%s) to %d: the KV pool holds %d tokens (%s); for the full context give "
        "--max-total-tokens %d or more (or a larger --mem-fraction-static), or pass --context-length %d to accept it",
        tokens,
        source,
        pool_tokens,
        pool_tokens,
        pool_rule,
        tokens,
        pool_tokens,
    )
    return ServedContext(pool_tokens, f"{source}, cut to the KV pool")


def minimal_chat_tokens(tokenizer: Any) -> int | None:
    """Tokens of the shortest chat prompt: one one-word user message through the tokenizer's chat template, with
    the generation prompt (as ``render_prompt`` renders requests). None when the tokenizer has no chat template or
    it cannot render that message."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template(_PROBE_CHAT, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: no chat to measure
        return None
    return len(ids)


def warn_if_too_short_for_chat(context_tokens: int, tokenizer: Any) -> None:
    """One WARNING when a one-word chat (``minimal_chat_tokens``) leaves no room in ``context_tokens`` for a reply:
    every chat request would then be answered 400."""
    need = minimal_chat_tokens(tokenizer)
    if need is None or context_tokens > need:
        return
    logger.warning(
        "context of %d tokens is too short for a chat: the chat template makes a one-word message %d tokens, so "
        "every /v1/chat/completions request will be refused (400); give --max-total-tokens (and --context-length) "
        "of a few thousand tokens",
        context_tokens,
        need,
    )
