"""Few-shot question answering over a batch: every program starts with the same examples, so with ``run_batch``
the engine prefills them once and serves them from its radix cache to every other program."""

from __future__ import annotations

from typing import Any

import radixserve.lang as sgl

EXAMPLES = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Egypt?", "Cairo"),
    ("What is the capital of Canada?", "Ottawa"),
    ("What is the capital of Kenya?", "Nairobi"),
    ("What is the capital of Peru?", "Lima"),
    ("What is the capital of Norway?", "Oslo"),
]
FEW_SHOT = "Answer each question with one word.\n\n" + "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in EXAMPLES)


@sgl.function
def few_shot_qa(s: Any, question: str) -> None:
    s += FEW_SHOT
    s += "Question: " + question + "\n"
    s += "Answer:" + sgl.gen("answer", max_tokens=8, stop="\n")


QUESTIONS = [
    "What is the capital of Germany?",
    "What is the capital of Spain?",
    "What is the capital of China?",
    "What is the capital of Brazil?",
]


def run_example() -> list[Any]:
    """Answer ``QUESTIONS`` as one batch, with a progress bar."""
    return few_shot_qa.run_batch([{"question": q} for q in QUESTIONS], progress_bar=True)


if __name__ == "__main__":
    from _common import backend_from_args

    backend_from_args(__doc__ or "")
    for q, state in zip(QUESTIONS, run_example()):
        print(f"{q} {state['answer'].strip()}")
