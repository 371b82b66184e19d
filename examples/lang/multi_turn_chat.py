"""Multi-turn chat: each turn's gen sends the whole conversation so far, of which the engine has everything but the
new user message cached from the turn before."""

from __future__ import annotations

from typing import Any

import radixserve.lang as sgl


@sgl.function
def multi_turn(s: Any, questions: list[str]) -> None:
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    for i, question in enumerate(questions):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=16, stop="\n"))


QUESTIONS = ["What is a good name for a cat?", "Why is that a good name?", "Suggest one more."]


def run_example() -> Any:
    """One conversation of ``QUESTIONS``."""
    return multi_turn.run(questions=QUESTIONS)


if __name__ == "__main__":
    from _common import backend_from_args

    backend_from_args(__doc__ or "")
    for message in run_example().messages():
        print(f"{message['role']:>9}: {message['content']}")
