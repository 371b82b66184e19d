"""Issue 11 (round 2, item 9): a request field of the wrong JSON type is a 400 naming the field, as OpenAI answers,
never coerced by pydantic's lax mode (the newcomer's ``"stream": "yes"`` and ``"logprobs": "yes"`` answered 200).

Real engine HTTP layer over a scripted fake engine (tests/fake_engine.py) and a real router in front, served by
uvicorn; the router relays the engine's 400 unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve.engine.server.http import create_app as engine_app
from radixserve.router.app import create_app as router_app
from radixserve.router.config import RouterArgs

from fake_engine import FakeEngine, ServerThread, load_tokenizer, wait_until

MSGS = [{"role": "user", "content": "Say hello."}]
CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"

# (path, body, param, what pydantic expects): every boolean field of the request models, and integers / numbers sent
# as strings, booleans or (for an integer) a float, which OpenAI refuses too ("Invalid type for 'n' ...").
WRONG_TYPES = [
    (CHAT, {"messages": MSGS, "stream": "yes"}, "stream", "boolean"),
    (CHAT, {"messages": MSGS, "logprobs": "yes"}, "logprobs", "boolean"),
    (CHAT, {"messages": MSGS, "stream": 1}, "stream", "boolean"),
    (CHAT, {"messages": MSGS, "ignore_eos": "true"}, "ignore_eos", "boolean"),
    (CHAT, {"messages": MSGS, "skip_special_tokens": 0}, "skip_special_tokens", "boolean"),
    (CHAT, {"messages": MSGS, "no_stop_trim": "no"}, "no_stop_trim", "boolean"),
    (CHAT, {"messages": MSGS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    (CHAT, {"messages": MSGS, "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options", "boolean"),
    (CHAT, {"messages": MSGS, "max_tokens": "12"}, "max_tokens", "integer"),
    (CHAT, {"messages": MSGS, "max_tokens": 12.0}, "max_tokens", "integer"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": True}, "max_completion_tokens", "integer"),
    (CHAT, {"messages": MSGS, "n": "2"}, "n", "integer"),
    (CHAT, {"messages": MSGS, "seed": "7"}, "seed", "integer"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": "2"}, "top_logprobs", "integer"),
    (CHAT, {"messages": MSGS, "temperature": "0.5"}, "temperature", "number"),
    (CHAT, {"messages": MSGS, "top_p": True}, "top_p", "number"),
    (COMPLETIONS, {"prompt": "Hi", "stream": "yes"}, "stream", "boolean"),
    (COMPLETIONS, {"prompt": "Hi", "echo": "yes"}, "echo", "boolean"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": True}, "logprobs", "integer"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": "12"}, "max_tokens", "integer"),
    (COMPLETIONS, {"prompt": [1, 2.0]}, "prompt", "integer"),
    (GENERATE, {"text": "Hi", "stream": "yes"}, "stream", "boolean"),
    (GENERATE, {"text": "Hi", "return_logprob": "yes"}, "return_logprob", "boolean"),
    (GENERATE, {"text": "Hi", "return_text_in_logprobs": 1}, "return_text_in_logprobs", "boolean"),
    (GENERATE, {"text": "Hi", "top_logprobs_num": "2"}, "top_logprobs_num", "integer"),
]


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    """{"engine": URL, "router": URL}: one fake engine behind the real engine HTTP layer, one router in front."""
    engine = FakeEngine(load_tokenizer())
    with contextlib.ExitStack() as stack:
        engine_url = stack.enter_context(ServerThread(engine_app(engine, manage_engine=False)))
        router_url = stack.enter_context(
            ServerThread(router_app(RouterArgs(worker_urls=[engine_url], health_interval_s=0.5)))
        )
        assert wait_until(lambda: httpx.get(router_url + "/health").json()["routable_workers"] == 1, 30)
        yield {"engine": engine_url, "router": router_url}


@pytest.mark.parametrize("via", ["engine", "router"])
@pytest.mark.parametrize(("path", "body", "param", "expected"), WRONG_TYPES)
def test_a_field_of_the_wrong_type_is_a_400_naming_it(urls, via, path, body, param, expected):
    r = httpx.post(urls[via] + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"].startswith(param), error  # stream_options.include_usage, prompt[1] ...
    assert f"Input should be a valid {expected}" in error["message"]


@pytest.mark.parametrize("via", ["engine", "router"])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        # OpenAI reads a JSON integer as a number: "temperature": 1 is fine.
        (CHAT, {"messages": MSGS, "temperature": 1, "top_p": 1, "max_tokens": 4, "stream": False, "logprobs": False}),
        (CHAT, {"messages": MSGS, "max_tokens": 4, "logit_bias": {}, "presence_penalty": 0}),
        (COMPLETIONS, {"prompt": [1, 2], "max_tokens": 4, "temperature": 0, "echo": False}),
        (GENERATE, {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": 1}, "return_logprob": True}),
    ],
)
def test_the_types_openai_accepts_still_pass(urls, via, path, body: dict[str, Any]):
    r = httpx.post(urls[via] + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
