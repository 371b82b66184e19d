"""Hypothesis strategies for hostile request bodies, and the checks every answer to one must pass (tests/test_fuzz*.py).

Bodies start from a valid request of each generation endpoint and get one to three fields (top-level or nested:
``messages[0].content``, ``sampling_params.max_new_tokens``, ``tools[0].function.parameters``, ...) replaced by odd
values: wrong types, huge and negative numbers, raw ``NaN`` / ``Infinity`` / ``1e999`` literals (Python's JSON reader
takes them), NaN and inf as strings, text with lone surrogates, NUL and other control characters, deep nesting, huge
arrays. Besides, raw bodies: broken or truncated JSON, invalid UTF-8, JSON that is not an object, wrong content
types. The budget: ``RADIXSERVE_FUZZ_EXAMPLES`` examples per test (default ``CI_EXAMPLES``, about a minute for all
the fuzz tests on 2 cores); raise it for a longer hunt, e.g. ``RADIXSERVE_FUZZ_EXAMPLES=2000``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import anyio
import httpx
import schemathesis
from anyio.from_thread import BlockingPortal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from radixserve.contracts.protocol import error_type

CI_EXAMPLES = 60
TIMEOUT_S = 30.0  # per request: a hang fails the example instead of the whole run
EXAMPLES = int(os.environ.get("RADIXSERVE_FUZZ_EXAMPLES", CI_EXAMPLES))
# derandomize: the same examples on every run (CI never hinges on a lucky draw); no database, so a local failure
# found once does not make later runs slower or different.
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
ENDPOINTS = (CHAT, COMPLETIONS, GENERATE)

VALID: dict[str, dict[str, Any]] = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
    COMPLETIONS: {"model": MODEL, "prompt": "Once upon", "max_tokens": 4},
    GENERATE: {"text": "Once upon", "sampling_params": {"max_new_tokens": 4}},
}

# Where an odd value goes: top-level fields of each endpoint (with SGLang's extra keys), and nested paths.
_SAMPLING = [
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
    "stop", "stop_token_ids", "ignore_eos", "n", "json_schema", "regex", "ebnf", "no_stop_trim",
    "skip_special_tokens", "logit_bias",
]  # fmt: skip
FIELDS: dict[str, list[tuple[str | int, ...]]] = {
    CHAT: [
        (k,)
        for k in [
            "model",
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "stream",
            "stream_options",
            "logprobs",
            "top_logprobs",
            "response_format",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "user",
            "cache_salt",
            "reasoning_effort",
            "functions",
            "function_call",
            "best_of",
            *_SAMPLING,
        ]  # fmt: skip
    ]
    + [
        ("messages", 0),
        ("messages", 0, "role"),
        ("messages", 0, "content"),
        ("messages", 0, "name"),
        ("messages", 0, "tool_calls"),
        ("stream_options", "include_usage"),
        ("response_format", "type"),
        ("response_format", "json_schema"),
        ("tools", 0),
        ("tools", 0, "function"),
        ("tools", 0, "function", "name"),
        ("tools", 0, "function", "parameters"),
        ("tool_choice", "function"),
    ],  # fmt: skip
    COMPLETIONS: [
        (k,)
        for k in [
            "model",
            "prompt",
            "max_tokens",
            "stream",
            "stream_options",
            "logprobs",
            "echo",
            "suffix",
            "best_of",
            "user",
            *_SAMPLING,
        ]  # fmt: skip
    ]
    + [("prompt", 0), ("stream_options", "include_usage"), ("response_format", "type")],
    GENERATE: [
        (k,)
        for k in [
            "text",
            "input_ids",
            "sampling_params",
            "stream",
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "return_text_in_logprobs",
            "rid",
            "model",
        ]  # fmt: skip
    ]
    + [("sampling_params", k) for k in ["max_new_tokens", *_SAMPLING]]
    + [("text", 0), ("input_ids", 0), ("sampling_params", 0)],
}

_WEIRD_STRINGS = [
    "NaN", "nan", "Infinity", "-Infinity", "inf", "-inf", "1e999", "-0", "0x10", "12", "12.0", "true", "null", "",
    " ", "\x00", "a\x00b", "\ud800", "\udfff", "x\ud83dy", "\u202e", "🙂" * 50, "<|im_end|>", "<tool_call>",
    "{}", "[]", "a" * 5000,
]  # fmt: skip
_NUMBERS = [
    0, -1, 1, 2**31, 2**63, 2**64 + 1, -(2**63) - 1, 10**400, -(10**400), 1.5, -0.0, 1e308, -1e308, 5e-324,
    float("nan"), float("inf"), float("-inf"),
]  # fmt: skip


def _text() -> st.SearchStrategy[str]:
    # Any code point, lone surrogates and NUL included (the JSON carries them as \u escapes).
    return st.text(st.characters(codec=None, categories=None), max_size=40)


def _nested(depth: int) -> Any:
    value: Any = 0
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


LEAVES: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(_NUMBERS),
    st.integers(),
    st.floats(),
    st.sampled_from(_WEIRD_STRINGS),
    _text(),
)
ODD_VALUES: st.SearchStrategy[Any] = st.one_of(
    LEAVES,
    st.recursive(
        LEAVES,
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(_text() | st.sampled_from(_SAMPLING), inner, max_size=4)
        ),
        max_leaves=12,
    ),
    st.sampled_from([10, 100, 3000]).map(_nested),  # deep nesting (3000 levels: past the recursion limit)
    st.sampled_from([0, -1, 49151, 49152, 2**31]).map(lambda t: [t] * 100_000),  # a huge array of token ids
    st.just(["x"] * 20_000),
    st.just([{"role": "user", "content": "hi"}] * 5_000),
)


_SMALL_INTS = st.one_of(st.integers(-3, 8), st.sampled_from([0, 1, 20, 21, 128, 129, 511, 512, 2**31 - 1, 2**63]))
_FLOATS = st.one_of(
    st.sampled_from([0.0, 1e-9, 0.5, 1.0, 2.0, -0.5, -2.0, 100.0, 1e30, float("nan"), float("inf")]),
    st.floats(-3, 3),
)
_SCHEMA_KEYWORDS = st.sampled_from(
    [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "string", "pattern": "[a-z]+", "maxLength": 3},
        {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
        {"enum": ["x", 1, None]},
        {"type": "integer", "minimum": 5, "maximum": 4},  # empty
        {"type": "object", "additionalProperties": False},
        {"$ref": "#/$defs/nope"},
        {"type": "nonsense"},
        {"not": {"type": "string"}},
        {"anyOf": []},
        {"type": "string", "format": "date-time"},
        {"const": "\ud800"},
        {},
        True,
        False,
    ]
)
_GRAMMAR_TEXT = st.one_of(
    st.sampled_from(
        ["[a-z]{3}", "(", "a{99999}", ".*", "\\d+", "", "\x00", "(?P<x>a)(?P=x)", "[^\\s\\S]", "a|", "\\ud800"]
    ),
    _text(),
)
_EBNF = st.one_of(st.sampled_from(['root ::= "a"', "root ::= x", "root ::=", 'root ::= "\\ud800"', "a ::= b"]), _text())
_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "function", "x"])},
        optional={
            "content": st.one_of(
                st.none(),
                _text(),
                st.lists(
                    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": _text()}), max_size=3
                ),
            ),
            "name": _text(),
            "tool_call_id": _text(),
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "id": _text(),
                        "type": st.just("function"),
                        "function": st.fixed_dictionaries(
                            {"name": _text(), "arguments": st.one_of(_text(), st.just("{}"), st.just('{"a": 1}'))}
                        ),
                    }
                ),
                max_size=2,
            ),
        },
    ),
    max_size=4,
)
_TOOL = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "function", "code_interpreter"]),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "get_weather", "x" * 65, "a b", ""]), "parameters": _SCHEMA_KEYWORDS},
            optional={"description": _text(), "strict": st.booleans()},
        ),
    }
)
_JSON_SCHEMA_FORMAT = st.fixed_dictionaries(
    {"name": _text(), "schema": _SCHEMA_KEYWORDS}, optional={"strict": st.booleans()}
)
_NAMED_TOOL_CHOICE = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "nope"])})}
)
_IDS = st.lists(st.integers(0, 49151), max_size=8)
# Values of the right type with edgy contents, for the fields that reach the real engine's paths (sampling,
# grammars, tools, logprobs, batching).
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": _SMALL_INTS, "max_completion_tokens": _SMALL_INTS, "max_new_tokens": _SMALL_INTS,
    "n": _SMALL_INTS, "top_k": _SMALL_INTS, "seed": _SMALL_INTS, "top_logprobs": _SMALL_INTS,
    "logprobs": st.one_of(st.booleans(), _SMALL_INTS), "top_logprobs_num": _SMALL_INTS,
    "logprob_start_len": st.one_of(_SMALL_INTS, st.lists(_SMALL_INTS, max_size=3)),
    "temperature": _FLOATS, "top_p": _FLOATS, "min_p": _FLOATS, "presence_penalty": _FLOATS,
    "frequency_penalty": _FLOATS, "repetition_penalty": _FLOATS,
    "stop": st.one_of(_text(), st.lists(_text(), max_size=5), st.sampled_from(["\n", " ", "<|im_end|>", "e"])),
    "stop_token_ids": st.lists(_SMALL_INTS, max_size=4),
    "ignore_eos": st.booleans(), "echo": st.booleans(), "stream": st.booleans(), "return_logprob": st.booleans(),
    "return_text_in_logprobs": st.booleans(), "skip_special_tokens": st.booleans(), "no_stop_trim": st.booleans(),
    "regex": _GRAMMAR_TEXT, "ebnf": _EBNF,
    "json_schema": st.one_of(_SCHEMA_KEYWORDS, _SCHEMA_KEYWORDS.map(json.dumps), _text()),
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text", "json_schema", "xml"])}),
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": _JSON_SCHEMA_FORMAT}),
    ),
    "tools": st.lists(_TOOL, max_size=3),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]), _NAMED_TOOL_CHOICE),
    "messages": _MESSAGES,
    "prompt": st.one_of(_text(), st.lists(_text(), max_size=3), _IDS, st.lists(_IDS, max_size=3)),
    "text": st.one_of(_text(), st.lists(_text(), max_size=3)),
    "input_ids": st.one_of(_IDS, st.lists(_IDS, max_size=3)),
    "rid": st.one_of(_text(), st.lists(_text(), max_size=3)),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "1", "49151", "-1", "x"]), _FLOATS, max_size=2),
    "content": st.one_of(_text(), st.none()),
    "role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
    "parameters": _SCHEMA_KEYWORDS,
}  # fmt: skip


def _put(body: Any, path: tuple[str | int, ...], value: Any) -> None:
    """Set ``body[path]`` to ``value``, making the containers on the way (a list for an int key) where missing or of
    another type."""
    node = body
    for key, nxt in zip(path, path[1:]):
        if isinstance(key, int):
            if not isinstance(node, list):
                return
            while len(node) <= key:
                node.append({} if isinstance(nxt, str) else [])
            if not isinstance(node[key], (dict, list)):
                node[key] = {} if isinstance(nxt, str) else []
            node = node[key]
        else:
            if not isinstance(node, dict):
                return
            if not isinstance(node.get(key), (dict, list)):
                node[key] = {} if isinstance(nxt, str) else []
            node = node[key]
    last = path[-1]
    if isinstance(last, int) and isinstance(node, list):
        while len(node) <= last:
            node.append(None)
        node[last] = value
    elif isinstance(last, str) and isinstance(node, dict):
        node[last] = value


@st.composite
def mutated_body(draw: st.DrawFn, path: str) -> dict[str, Any]:
    """A valid body of ``path`` with one to three fields replaced by odd values (or deleted)."""
    body = json.loads(json.dumps(VALID[path]))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(FIELDS[path]))
        if draw(st.integers(0, 9)) == 0 and len(where) == 1:
            body.pop(where[0], None)
        else:
            plausible = PLAUSIBLE.get(str(where[-1]))
            odd = plausible is None or draw(st.integers(0, 2)) == 0  # mostly the right type with edgy contents
            _put(body, where, draw(ODD_VALUES if odd else plausible))
    if draw(st.booleans()):
        body["stream"] = True
    return body


def encode(body: Any) -> bytes:
    """JSON bytes as a client may send them: NaN / Infinity as bare literals, lone surrogates as \\u escapes; a
    structure too deep for ``json.dumps`` is written by hand."""
    try:
        return json.dumps(body, allow_nan=True).encode()
    except RecursionError:
        return b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


_CONTENT_TYPES = [
    "application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "application/vnd.api+json",
    "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx",
    "application/json; charset=latin-1", "", "*/*",
]  # fmt: skip


@st.composite
def raw_request(draw: st.DrawFn, path: str) -> tuple[bytes, dict[str, str]]:
    """``(body bytes, headers)``: broken bytes or a good body under an odd ``Content-Type`` (or none)."""
    good = encode(draw(mutated_body(path)) if draw(st.booleans()) else VALID[path])
    raw = draw(
        st.one_of(
            st.just(good),
            st.integers(0, max(len(good) - 1, 0)).map(lambda n: good[:n]),  # truncated
            st.binary(max_size=64),
            st.sampled_from(
                [
                    b"",
                    b"   ",
                    b"null",
                    b"[]",
                    b"[1, 2]",
                    b'"text"',
                    b"42",
                    b"NaN",
                    b"{",
                    b"}",
                    b"{,}",
                    b'{"a": 1,}',
                    b"\xff\xfe\x00",
                    b"\xef\xbb\xbf" + good,
                    b"\xc3\x28",
                    b'{"prompt": "\xff"}',
                    b'{"a": 1} {"b": 2}',
                    b"[" * 100_000,
                    b'{"a":' * 50_000,
                    good.replace(b":", b"=", 1),
                    good + b"\x00",
                    b'{"messages": "' + b"\\ud800" * 3 + b'"}',
                ]
            ),  # fmt: skip
        )
    )
    ctype = draw(st.sampled_from(_CONTENT_TYPES + ["(none)"]))
    headers = {} if ctype == "(none)" else {"content-type": ctype}
    return raw, headers


# A lone client never fills the queue (429) and the servers are up (503): those would be bugs here too.
_STATUSES = frozenset({400, 404, 405, 413})


def check_answer(status: int, content_type: str, body: bytes, what: str, allowed: frozenset[int] | None = None) -> None:
    """Assert an answer to a fuzzed request keeps the contract (docs/contracts.md, "Errors"): a status in ``allowed``
    (default 400, 404, 405, 413: no 5xx, no 422) with the OpenAI error body (``code`` = the status, ``type`` by
    status), or a 2xx: JSON, or an SSE stream that ends in ``data: [DONE]`` whose error events (if any) have that
    body and an allowed code. ``what`` describes the request."""
    ok = allowed if allowed is not None else _STATUSES
    if status >= 300:
        assert status in ok, f"{status} for {what}: {body[:500]!r}"
        _check_error(json.loads(body), status, what)
        return
    if content_type.startswith("text/event-stream"):
        text = body.decode("utf-8")
        assert text.endswith("data: [DONE]\n\n"), f"stream without [DONE] for {what}: {text[-300:]!r}"
        for event in text.split("\n\n")[:-2]:
            assert event.startswith("data: "), f"bad SSE framing for {what}: {event[:200]!r}"
            payload = json.loads(event[len("data: ") :])
            if "error" in payload:
                code = payload["error"].get("code")
                assert code in ok, f"stream error event {code} for {what}: {payload!r}"
                _check_error(payload, code, what)
        return
    if content_type.startswith("application/json"):
        json.loads(body)


def _check_error(payload: Any, status: int, what: str) -> None:
    assert isinstance(payload, dict) and set(payload) == {"error"}, f"not the error body for {what}: {payload!r}"
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, f"error keys for {what}: {err!r}"
    assert isinstance(err["message"], str) and err["message"], f"empty message for {what}: {err!r}"
    assert err["code"] == status, f"code {err['code']} != status {status} for {what}"
    assert err["type"] == error_type(status), f"type {err['type']} for status {status} for {what}"
    assert err["param"] is None or isinstance(err["param"], str), f"param for {what}: {err!r}"


def check(resp: httpx.Response, what: str) -> None:
    """``check_answer`` on an httpx response."""
    check_answer(resp.status_code, resp.headers.get("content-type", ""), resp.content, what)


class AsgiClient:
    """Requests to an ASGI app on an event loop in a background thread (the app's lifespan run around them)."""

    def __init__(self, portal: BlockingPortal, app: Any) -> None:
        self.portal = portal
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fuzz", timeout=None)

    def request(
        self,
        method: str,
        path: str,
        content: bytes = b"",
        headers: dict[str, str] | None = None,
        params: Any = None,
    ) -> Any:
        async def call() -> httpx.Response:
            with anyio.fail_after(TIMEOUT_S):
                return await self.http.request(method, path, content=content, headers=headers, params=params)

        return self.portal.call(call)

    def post_json(self, path: str, body: Any) -> httpx.Response:
        return self.request("POST", path, encode(body), {"content-type": "application/json"})  # type: ignore[no-any-return]


def still_serves(client: AsgiClient) -> None:
    """A normal request of each endpoint is answered correctly after the fuzzing: 200, one finished result of at
    most ``max_tokens`` tokens."""
    for path in ENDPOINTS:
        resp = client.post_json(path, VALID[path])
        assert resp.status_code == 200, resp.text
        out = resp.json()
        if path == GENERATE:
            assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length"), out
            assert 0 < out["meta_info"]["completion_tokens"] <= 4, out
        else:
            assert [c["finish_reason"] in ("stop", "length") for c in out["choices"]] == [True], out
            assert 0 < out["usage"]["completion_tokens"] <= 4, out


class HttpClient(AsgiClient):
    """The same calls to a server over HTTP (a real engine process)."""

    def __init__(self, base_url: str) -> None:
        self.sync = httpx.Client(base_url=base_url, timeout=TIMEOUT_S)

    def request(
        self, method: str, path: str, content: bytes = b"", headers: dict[str, str] | None = None, params: Any = None
    ) -> Any:
        return self.sync.request(method, path, content=content, headers=headers, params=params)


def case_request(case: Any) -> tuple[str, str, bytes, dict[str, str], Any]:
    """A schemathesis ``Case`` as ``(method, path, body bytes, headers, query params)`` for ``AsgiClient.request``."""
    kwargs = case.as_transport_kwargs(base_url="http://fuzz")
    content = kwargs.get("data") or (encode(kwargs["json"]) if "json" in kwargs else b"")
    if isinstance(content, str):
        content = content.encode()
    headers = {k: v for k, v in (kwargs.get("headers") or {}).items() if isinstance(v, str)}
    if "json" in kwargs:
        headers.setdefault("content-type", "application/json")
    return kwargs["method"], kwargs["url"].removeprefix("http://fuzz"), content, headers, kwargs.get("params")


def fuzz_schema(client: AsgiClient, examples: int, after: Any = None) -> None:
    """Schemathesis over every operation of the server's own ``GET /openapi.json``: ``examples`` schema-valid or
    schema-violating requests each, every answer checked (``check``); ``after()``, if given, runs after each."""
    schema = schemathesis.openapi.from_dict(client.request("GET", "/openapi.json").json())
    for result in schema.get_all_operations():
        _fuzz_operation(client, result.ok(), examples, after)


def _fuzz_operation(client: AsgiClient, op: Any, examples: int, after: Any) -> None:
    strategy = op.as_strategy(GenerationMode.POSITIVE) | op.as_strategy(GenerationMode.NEGATIVE)

    @settings(FUZZ_SETTINGS, max_examples=examples)
    @given(case=strategy)
    def run(case: Any) -> None:
        method, path, content, headers, params = case_request(case)
        check(client.request(method, path, content, headers, params), f"{op.label} {case!r}")
        if after is not None:
            after()

    run()
