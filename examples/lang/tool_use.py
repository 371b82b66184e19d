"""Tool use: the model names a city (constrained by a regex), the program calls a Python function with it, and the
function's result goes back into the text for the model's answer."""

from __future__ import annotations

from typing import Any

import radixserve.lang as sgl

# One capitalized word after a space: the prompt ends at "city:" (a prompt ending in a space puts a small model at an
# odd token boundary), and a single word keeps it from running on past the name.
CITY_REGEX = r" [A-Z][a-z]+"
CALLS: list[str] = []


def get_weather(city: str) -> str:
    """A stand-in weather service."""
    CALLS.append(city)
    return f'{{"city": "{city}", "forecast": "sunny", "high_c": 24}}'


@sgl.function
def weather_assistant(s: Any, question: str) -> None:
    s += sgl.system("You can look up the weather with the get_weather(city) tool.")
    s += sgl.user(question)
    s += sgl.assistant("Calling get_weather for the city:" + sgl.gen("city", regex=CITY_REGEX, max_tokens=8))
    result = get_weather(s["city"].strip())  # the program waits for the gen, then runs ordinary Python
    s += sgl.user(f"get_weather returned {result}. Now answer my question in one sentence.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=24, stop="\n"))


def run_example() -> Any:
    """Ask about the weather in Lisbon."""
    return weather_assistant.run(question="What is the weather like in Lisbon today?")


if __name__ == "__main__":
    from _common import backend_from_args

    backend_from_args(__doc__ or "")
    state = run_example()
    print(f"tool called with {state['city']!r}; answer: {state['answer'].strip()}")
