"""How ``select`` picks a choice from the engine's logprobs of each choice's tokens (SGLang's ``choices.py``).

Each method gets, per choice, the prompt-token logprobs of the tokens that spell the choice (SGLang's
``input_token_logprobs`` entries ``[logprob | None, token_id, text | None]``) and their mean, and returns a
``ChoicesDecision``: the chosen text and the meta info ``s.get_meta_info(name)`` shows.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

# One token of a prompt or completion as the engine reports it: [logprob | None, token_id, text | None].
TokenLogprob = list[Any]


@dataclass
class ChoicesDecision:
    """The chosen text and what it was chosen on (``meta_info``, the select variable's meta info)."""

    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


def mean_logprob(tokens: list[TokenLogprob]) -> float:
    """The mean of the tokens' logprobs, skipping unknown ones (None: a prompt's first token); -inf for none."""
    values = [float(t[0]) for t in tokens if t[0] is not None]
    return sum(values) / len(values) if values else -math.inf


def _argmax_first(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


class ChoicesSamplingMethod(ABC):
    """A way to pick one of the choices from their token logprobs."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        """Whether the method also needs each choice's logprobs without the prompt (one more request)."""
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[TokenLogprob]],
        output_token_logprobs: list[list[TokenLogprob]],
        unconditional_token_logprobs: list[list[TokenLogprob]] | None = None,
    ) -> ChoicesDecision:
        """Pick a choice. Lists are indexed like ``choices``; ``normalized_prompt_logprobs`` are the per-choice
        means of ``input_token_logprobs``."""

    def _meta(
        self,
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[TokenLogprob]],
        output_token_logprobs: list[list[TokenLogprob]],
    ) -> dict[str, Any]:
        return {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
        }


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (SGLang's default)."""

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[TokenLogprob]],
        output_token_logprobs: list[list[TokenLogprob]],
        unconditional_token_logprobs: list[list[TokenLogprob]] | None = None,
    ) -> ChoicesDecision:
        best = _argmax_first(normalized_prompt_logprobs)
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        return ChoicesDecision(choices[best], meta)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Token by token: keep the choices whose token at position j has the highest logprob, until one is left. A
    choice shorter than another is padded with its own mean logprob."""

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[TokenLogprob]],
        output_token_logprobs: list[list[TokenLogprob]],
        unconditional_token_logprobs: list[list[TokenLogprob]] | None = None,
    ) -> ChoicesDecision:
        width = max(len(tokens) for tokens in input_token_logprobs)
        matrix: list[list[float]] = []
        for tokens in input_token_logprobs:
            row = [float(t[0]) if t[0] is not None else 0.0 for t in tokens]
            pad = sum(row) / len(row) if row else -math.inf
            matrix.append(row + [pad] * (width - len(row)))
        remaining = list(range(len(choices)))
        for j in range(width):
            top = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == top]
            if len(remaining) == 1:
                break
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[remaining[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice whose tokens gain most from the prompt: the mean of (logprob with the prompt − logprob without it).
    The first token's unconditional logprob is unknown and counts as 0."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[TokenLogprob]],
        output_token_logprobs: list[list[TokenLogprob]],
        unconditional_token_logprobs: list[list[TokenLogprob]] | None = None,
    ) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional token logprobs are required for this method")
        scores: list[float] = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError("input and unconditional token logprobs must have the same length")
            diffs = [(c[0] or 0.0) - (u[0] or 0.0) for c, u in zip(cond, uncond)]
            scores.append(sum(diffs) / len(diffs) if diffs else -math.inf)
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[_argmax_first(scores)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def choice_tokens(entries: list[TokenLogprob], choice: str) -> list[TokenLogprob] | None:
    """The trailing tokens of a prompt that spell ``choice`` (its last characters), from the prompt's
    ``input_token_logprobs`` entries with texts: walking back from the end until the texts cover ``choice``. The
    first of them may also hold the end of the text before the choice (the tokenizer merged them), as SGLang's
    token healing keeps it. None when the entries run out first (they started after the choice's first token) or
    carry no texts."""
    if not choice:
        return []
    covered = 0
    for i in range(len(entries) - 1, -1, -1):
        text = entries[i][2]
        if not isinstance(text, str):
            return None
        covered += len(text)
        if covered >= len(choice):
            return entries[i:]
    return None
