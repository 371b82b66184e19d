"""``select``: the engine scores every choice after the shared text in one request (the logprobs of each choice's
tokens) and the program continues with the best one. ``get_meta_info`` shows the scores."""

from __future__ import annotations

from typing import Any

import radixserve.lang as sgl

OPTIONS = ["red", "green", "blue"]


@sgl.function
def pick_color(s: Any, thing: str) -> None:
    s += sgl.user(f"What color is {thing}? Answer with one of: {', '.join(OPTIONS)}.")
    s += sgl.assistant("The color is " + sgl.select("color", choices=OPTIONS) + ".")
    # The same choice by greedy token selection (SGLang's choices_method) instead of the mean token logprob.
    s += sgl.user("Say it once more.")
    s += sgl.assistant(sgl.select("again", choices=OPTIONS, choices_method=sgl.greedy_token_selection))


def run_example() -> Any:
    """Pick the color of grass."""
    return pick_color.run(thing="fresh grass")


if __name__ == "__main__":
    from _common import backend_from_args

    backend_from_args(__doc__ or "")
    state = run_example()
    scores = state.get_meta_info("color")["normalized_prompt_logprobs"]
    print(f"color: {state['color']} (mean token logprobs {dict(zip(OPTIONS, scores))}); again: {state['again']}")
