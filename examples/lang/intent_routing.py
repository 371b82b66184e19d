"""Intent routing: judge whether a message is about the weather or just chat, then answer by branch.

The Python ``if`` sees the judgement of the first step, and the second step continues the same text, so its prompt
is served from the radix cache (and the router keeps the program on the engine that holds it).
"""

from __future__ import annotations

from typing import Any

import radixserve.lang as sgl

INTENTS = ["weather", "chat"]


@sgl.function
def route(s: Any, message: str) -> None:
    s += sgl.system("You sort messages into intents and then answer them briefly.")
    s += sgl.user(f"Message: {message}\nIs this message about the weather, or is it chat?")
    s += sgl.assistant("The intent is " + sgl.gen("intent", choices=INTENTS) + ".")
    if s["intent"] == "weather":
        s += sgl.user("Answer the weather question in one sentence, as a forecaster would.")
    else:
        s += sgl.user("Reply to the message in one friendly sentence.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=24, stop="\n"))


MESSAGES = ["Will it rain in Paris tomorrow?", "Hi! How was your weekend?"]


def run_example() -> list[Any]:
    """Route each of ``MESSAGES`` (one program each, run as a batch)."""
    return route.run_batch([{"message": m} for m in MESSAGES])


if __name__ == "__main__":
    from _common import backend_from_args

    backend_from_args(__doc__ or "")
    for message, state in zip(MESSAGES, run_example()):
        print(f"{message!r} -> {state['intent']}: {state['answer'].strip()}")
