"""The soak's request mix (bench/soak.py): what each client sends, drawn at random by weight.

Each ``Spec`` is one request and what a correct answer looks like: ``expect`` ``serve`` (a 200, checked by
bench/soak_check.py) or ``refuse`` (a prompt too long for the context, or a body over the size limit: the right
answer is a clean 400 / 413). Kinds: chat and completions, streamed or not; ``json_schema`` response formats
(validated); ``n`` > 1; forced tool calls (their arguments validated); streams the client abandons after a few
events; prompts big enough that a few at once exhaust a small KV pool; prompts longer than the context; prompt +
``max_tokens`` over the context; bodies over ``--max-request-body-bytes``.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

from _common import VOCAB

MODEL = "smollm2-135m-instruct"

# Bounded schemas, so that a reply within max_tokens usually closes its JSON (a reply cut by "length" is not checked).
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
            "done": {"type": "boolean"},
        },
        "required": ["items", "done"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}, "rain": {"type": "boolean"}},
        "required": ["city", "rain"],
        "additionalProperties": False,
    },
]
WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_PARAMS},
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
SYSTEM = "You are a concise support assistant. " + " ".join(VOCAB[:40])  # a shared prefix: the radix cache's work


@dataclass
class Spec:
    """One request: ``kind`` (its row in the report), ``path``, JSON ``body`` (or raw ``content`` bytes), whether it
    streams, how many ``choices`` a reply has, and how to judge it: ``expect`` ``serve`` | ``refuse``, the JSON
    ``schema`` its content must meet, ``tools`` (name -> parameters schema) its calls must meet, ``abandon_after``
    (events read before the client hangs up; 0: read to the end)."""

    kind: str
    path: str
    body: dict[str, Any] | None
    stream: bool = False
    choices: int = 1
    expect: str = "serve"
    schema: dict[str, Any] | None = None
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)
    abandon_after: int = 0
    content: bytes | None = None


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def _question(rng: random.Random) -> str:
    return f"[{uuid.uuid4().hex[:8]}] {_words(rng, rng.randint(4, 24))}?"


def _chat(rng: random.Random, max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _question(rng)}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": stream, **extra}


def chat(rng: random.Random) -> Spec:
    stream = rng.random() < 0.5
    body = _chat(rng, rng.randint(8, 48), stream)
    return Spec("chat_stream" if stream else "chat", "/v1/chat/completions", body, stream)


def completion(rng: random.Random) -> Spec:
    stream = rng.random() < 0.5
    body = {"model": MODEL, "prompt": _question(rng), "max_tokens": rng.randint(8, 48), "stream": stream}
    return Spec("completion_stream" if stream else "completion", "/v1/completions", body, stream)


def json_schema(rng: random.Random) -> Spec:
    stream = rng.random() < 0.5
    schema = rng.choice(SCHEMAS)
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
    body = _chat(rng, 96, stream, response_format=fmt)
    return Spec("json_schema_stream" if stream else "json_schema", "/v1/chat/completions", body, stream, schema=schema)


def n_choices(rng: random.Random) -> Spec:
    stream = rng.random() < 0.5
    body = _chat(rng, rng.randint(8, 32), stream, n=2, temperature=0.8, seed=rng.randint(0, 2**31))
    return Spec("n2_stream" if stream else "n2", "/v1/chat/completions", body, stream, choices=2)


def tool_call(rng: random.Random) -> Spec:
    stream = rng.random() < 0.5
    choice: Any = rng.choice(["required", {"type": "function", "function": {"name": "get_weather"}}])
    body = _chat(rng, 64, stream, tools=TOOLS, tool_choice=choice)
    body["messages"][-1]["content"] = f"What is the weather in {rng.choice(['Paris', 'Oslo', 'Lima'])}?"
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    return Spec("tools_stream" if stream else "tools", "/v1/chat/completions", body, stream, tools=tools)


def abandoned_stream(rng: random.Random) -> Spec:
    body = _chat(rng, 200, True)
    return Spec("abandoned_stream", "/v1/chat/completions", body, True, abandon_after=rng.randint(1, 4))


def big_prompt(rng: random.Random) -> Spec:
    """~800-1,500 prompt tokens (a word is ~1.02 tokens): two at once, or one beside the running requests, overfill
    a 2,048-token pool, so requests queue and running ones are retracted (never an error)."""
    body = {"model": MODEL, "prompt": _words(rng, rng.randint(800, 1500)), "max_tokens": 24}
    return Spec("big_prompt", "/v1/completions", body)


def too_long(rng: random.Random) -> Spec:
    """A prompt past any context the soak's stack has (2,048 tokens): a 400."""
    body = {"model": MODEL, "prompt": _words(rng, rng.randint(2300, 3000)), "max_tokens": 8}
    return Spec("too_long", "/v1/completions", body, expect="refuse")


def over_context(rng: random.Random) -> Spec:
    """A prompt that fits, with ``max_tokens`` that does not: a 400 naming the numbers."""
    body = _chat(rng, 4096, rng.random() < 0.5)
    return Spec("over_context", "/v1/chat/completions", body, bool(body["stream"]), expect="refuse")


def too_big_body(limit_bytes: int) -> Spec:
    """A JSON body one KiB over ``limit_bytes``: a 413."""
    pad = "x" * (limit_bytes + 1024)
    content = json.dumps({"model": MODEL, "prompt": pad, "max_tokens": 1}).encode()
    return Spec("body_too_big", "/v1/completions", None, expect="refuse", content=content)


# kind builder -> weight. Streams under way when an engine dies can only end with an error event, so they are about
# a third of the mix, short, as in a chat front end.
WEIGHTS = [
    (chat, 24),
    (completion, 12),
    (json_schema, 14),
    (n_choices, 8),
    (tool_call, 10),
    (abandoned_stream, 8),
    (big_prompt, 8),
    (too_long, 3),
    (over_context, 3),
]


class Mix:
    """Draws ``Spec``s by ``WEIGHTS`` from ``seed``; one in ``body_every`` is ``big`` (``too_big_body``, built once
    and shared: it is large)."""

    def __init__(self, seed: int, big: Spec, body_every: int = 200) -> None:
        self.rng = random.Random(seed)
        self.big = big
        self.body_every = body_every
        self.builders = [b for b, _ in WEIGHTS]
        self.weights = [w for _, w in WEIGHTS]
        self.drawn = 0

    def next(self) -> Spec:
        self.drawn += 1
        if self.drawn % self.body_every == 0:
            return self.big
        return self.rng.choices(self.builders, self.weights)[0](self.rng)
