"""A JSON object built piece by piece: the program writes the keys and punctuation, constrained gens write the
values (``gen_string``, ``gen_int``, a ``regex``), so the result parses whatever the model would have written."""

from __future__ import annotations

import json
from typing import Any

import radixserve.lang as sgl

EMAIL_REGEX = r"[a-z]{2,12}@[a-z]{2,10}\.(com|org)"


@sgl.function
def character(s: Any, name: str) -> None:
    s += f"Fill in a short JSON record about {name}, a character in a story.\n"
    # No space after the colons: a prompt ending in a bare space leaves the model at an odd token boundary (it
    # would write ' "' as one token, which the value's pattern does not allow), and compact JSON parses the same.
    s += "{\n"
    s += '  "name":' + sgl.gen_string("name", max_tokens=16) + ",\n"
    s += '  "age":' + sgl.gen_int("age", max_tokens=4) + ",\n"
    s += '  "email":"' + sgl.gen("email", regex=EMAIL_REGEX, max_tokens=24) + '",\n'
    s += '  "hero":' + sgl.gen("hero", dtype=bool, max_tokens=3) + "\n"
    s += "}"


def record(state: Any) -> dict[str, Any]:
    """The JSON object of a finished ``character`` program (``True`` / ``False`` written as JSON booleans)."""
    text = state.text()
    obj = text[text.index("{") :].replace(":True\n", ":true\n").replace(":False\n", ":false\n")
    parsed: dict[str, Any] = json.loads(obj)
    return parsed


def run_example() -> Any:
    """A record about Harry Potter."""
    return character.run(name="Harry Potter")


if __name__ == "__main__":
    from _common import backend_from_args

    backend_from_args(__doc__ or "")
    print(json.dumps(record(run_example()), indent=2))
