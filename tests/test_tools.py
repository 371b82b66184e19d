"""Tools, output constraints, the reasoning parser and the OpenAI compatibility switches.

Pure unit tests (parsers, schemas, rendering), then the HTTP layer over the fake engine with scripted replies (the
request mapping: what reaches ``SamplingParams``), then the real model end to end (slow).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from fastapi.testclient import TestClient

from radixserve.contracts import constants
from radixserve.contracts.protocol import ChatCompletionRequest
from radixserve.engine.io_struct import InvalidRequestError, SamplingParams
from radixserve.engine.server.chat import RenderOptions, TemplateCaps, render_prompt
from radixserve.engine.server.http import create_app
from radixserve.engine.server.reasoning import ReasoningStream, make_reasoning_stream, split_reasoning
from radixserve.engine.server.tool_parser import ChatOutputParser, parse_tool_calls
from radixserve.engine.server.tools import (
    ToolChoice,
    call_schema,
    resolve_tool_choice,
    tools_prompt,
    validate_tools,
)

from fake_engine import (
    FakeEngine,
    ServerThread,
    load_tokenizer,
    sse_payloads,
    tokenizer,  # noqa: F401 - shared pytest fixture
)

MODEL = "smollm2-135m-instruct"
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 100},
                "b": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, ADD]
NAMES = {"get_weather", "add", "now"}

# A template WITH tool support and content lists (Qwen-like, reduced): renders tools, lists parts as [text].
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n"
    "{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def assert_error(r, status, *needles):
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(r.json()) == {"error"} and body["code"] == status and body["type"] == constants.ERROR_TYPES[status]
    for needle in needles:
        assert needle in body["message"] or needle == body["param"], body
    return body


def splits(text: str, seed: int) -> list[str]:
    """``text`` cut into random pieces (1-6 characters), as a stream of deltas."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        out.append(text[i:j])
        i = j
    return out


# ---------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "tools, needle",
    [
        ({"type": "function"}, "list"),
        ([{"type": "retrieval"}], "function tool"),
        ([{"type": "function", "function": "f"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters"),
        ([NOARGS, NOARGS], "duplicate"),
    ],
)
def test_validate_tools_rejects(tools, needle):
    with pytest.raises(InvalidRequestError) as e:
        validate_tools(tools)
    assert e.value.status_code == 400 and (needle in e.value.message or needle == e.value.param)


ARRAY_PARAMS = {"type": "array", "items": {"type": "integer"}}  # the tester's input (finding 1)


@pytest.mark.parametrize(
    "params, needle",
    [
        (ARRAY_PARAMS, 'type "object"'),
        ({"type": "foo"}, 'type "object"'),
        ({"type": "object", "properties": {"a": {"type": "foo"}}}, "parameters.properties.a has an invalid type"),
        ({"type": "object", "properties": {"a": {"type": ["string", "string"]}}}, "invalid type"),
        ({"type": "object", "properties": []}, "properties must be an object"),
        ({"type": "object", "required": "a"}, "required must be a list"),
        ({"type": "object", "properties": {"a": {"anyOf": []}}}, "anyOf must be a non-empty list"),
        ({"type": "object", "properties": {"a": {"type": "array", "items": 3}}}, "parameters.properties.a.items"),
        ({"type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}}, "maxLength"),
        ({"properties": {"a": {"type": "integer", "minimum": "0"}}}, "minimum must be a number"),
        ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0}}}, "multipleOf"),
        ({"type": "object", "$defs": {"d": {"enum": "x"}}}, "parameters.$defs.d enum"),
    ],
)
def test_validate_tools_rejects_bad_parameter_schemas(params, needle):
    # Regression (findings 1, 2): a non-object or invalid schema was accepted (caught only when a call was forced).
    with pytest.raises(InvalidRequestError) as e:
        validate_tools([NOARGS, {"type": "function", "function": {"name": "x", "parameters": params}}])
    assert e.value.status_code == 400 and e.value.param == "tools[1].function.parameters"
    assert needle in e.value.message, e.value.message


def test_validate_tools_accepts_object_schemas_with_type_implied():
    ok = [
        {},
        {"properties": {"a": {"type": ["string", "null"]}}},
        {
            "type": "object",
            "properties": {
                "a": {"type": "array", "items": [{"type": "integer"}], "minItems": 1},
                "b": {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.5},
                "c": {"$ref": "#/$defs/c"},
            },
            "$defs": {"c": {"anyOf": [{"type": "string"}, True]}},
        },
    ]
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": p}} for i, p in enumerate(ok)]
    fns = validate_tools(tools)
    assert [f["parameters"] for f in fns] == ok
    # a schema without "type" constrains forced arguments to an object all the same
    for fn in fns:
        args = call_schema([fn], ToolChoice("required"))["properties"]["arguments"]
        assert args["type"] == "object"
        assert not jsonschema.Draft7Validator(args).is_valid([])  # draft 7: "items" may be a list


def test_resolve_tool_choice():
    fns = validate_tools(TOOLS)
    assert resolve_tool_choice(fns, None) == ToolChoice("auto")
    assert resolve_tool_choice([], None) == ToolChoice("none")
    assert resolve_tool_choice(fns, "none") == ToolChoice("none")
    assert resolve_tool_choice(fns, "required") == ToolChoice("required")
    named = {"type": "function", "function": {"name": "add"}}
    assert resolve_tool_choice(fns, named) == ToolChoice("named", "add")
    # --tool-choice-as-auto: forced choices become auto, "none" stays none
    assert resolve_tool_choice(fns, named, as_auto=True) == ToolChoice("auto")
    assert resolve_tool_choice(fns, "required", as_auto=True) == ToolChoice("auto")
    assert resolve_tool_choice(fns, "none", as_auto=True) == ToolChoice("none")
    for bad, param in [
        ("sometimes", "tool_choice"),
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
        ({"type": "function"}, "tool_choice"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            resolve_tool_choice(fns, bad)
        assert e.value.param == param
    with pytest.raises(InvalidRequestError, match="no tools"):
        resolve_tool_choice([], "auto")


# ---------------------------------------------------------------------------------------------------- call schema


def test_call_schema_named_and_required():
    fns = validate_tools([WEATHER, ADD, NOARGS])
    weather_ok = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    add_ok = {"name": "add", "arguments": {"a": 1, "b": 2}}
    now_ok = {"name": "now", "arguments": {}}
    named = call_schema(fns, ToolChoice("named", "add"))
    jsonschema.validate(add_ok, named)
    for bad in [
        weather_ok,
        {"name": "add", "arguments": {"a": 1}},
        {"name": "add", "arguments": {"a": 1, "b": 101}},
        {"name": "add"},
        {"name": "add", "arguments": {"a": 1, "b": 2}, "extra": 1},
    ]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named)
    required = call_schema(fns, ToolChoice("required"))
    jsonschema.Draft202012Validator.check_schema(required)
    for ok in (weather_ok, add_ok, now_ok):
        jsonschema.validate(ok, required)
    for bad in [
        {"name": "add", "arguments": {"city": "Paris", "unit": "celsius"}},  # a name with another's arguments
        {"name": "other", "arguments": {}},
        {"arguments": {"a": 1, "b": 2}},
    ]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = call_schema(validate_tools([ADD]), ToolChoice("required"))
    assert single == named  # one tool: no anyOf
    with pytest.raises(ValueError):
        call_schema(fns, ToolChoice("auto"))


# ---------------------------------------------------------------------------------------------------- auto parser


@pytest.mark.parametrize(
    "text, content, calls",
    [
        (
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
            None,
            [("add", {"a": 1, "b": 2})],
        ),
        (
            'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            "</tool_call>",
            "Let me check.",
            [("get_weather", {"city": "Paris", "unit": "celsius"})],
        ),
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "now", '
            '"arguments": {}}</tool_call>',
            None,
            [("add", {"a": 1, "b": 2}), ("now", {})],
        ),
        (
            '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 6}}',
            None,
            [("add", {"a": 5, "b": 6})],
        ),  # no close tag
        ('<tool_call>{"name": "add", "parameters": {"a": 5, "b": 6}}</tool_call>', None, [("add", {"a": 5, "b": 6})]),
        ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>', None, [("add", {"a": 5})]),
        ('  {"name": "now", "arguments": {}}  ', None, [("now", {})]),  # bare JSON
        ('```json\n{"name": "now", "arguments": {}}\n```', None, [("now", {})]),
        (
            '[{"name": "now", "arguments": {}}, {"name": "add", "arguments": {"a": 0, "b": 0}}]',
            None,
            [("now", {}), ("add", {"a": 0, "b": 0})],
        ),
        # not calls: plain text, unknown tool, broken JSON, JSON that is not a call, non-object arguments
        ("The weather is sunny.", "The weather is sunny.", []),
        (
            '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
            [],
        ),
        (
            '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',
            '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',
            [],
        ),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
        ('{"name": "add", "arguments": [1, 2]}', '{"name": "add", "arguments": [1, 2]}', []),
        ("{not json", "{not json", []),
    ],
)
def test_parse_tool_calls(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got_calls] == calls


def run_parser(parser: ChatOutputParser, pieces: list[str]):
    reasoning, content = "", ""
    for piece in pieces:
        d = parser.feed(piece, 1)
        reasoning, content = reasoning + d.reasoning, content + d.content
        assert d.calls is None  # calls only come at the end
    d = parser.finish()
    return reasoning + d.reasoning, content + d.content, d.calls


AUTO_REPLIES = [
    "Sure, it is sunny in Paris today.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    'I will add them. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
    '\n\n{"name": "now", "arguments": {}}',
    "{ this is not json }",
    "Use <tool but not really.",
    "`code` first",
    "<tool_call>{broken</tool_call>",
]


@pytest.mark.parametrize("reply", AUTO_REPLIES)
def test_auto_parser_streamed_equals_whole(reply):
    whole = run_parser(ChatOutputParser("auto", NAMES), [reply])
    want_content, want_calls = parse_tool_calls(reply.lstrip(), NAMES)
    assert (whole[1].strip() or None) == (want_content.strip() if want_content else None)
    assert (whole[2] or []) == want_calls
    for seed in range(5):
        assert run_parser(ChatOutputParser("auto", NAMES), splits(reply, seed)) == whole


def test_auto_parser_streams_text_before_a_call():
    p = ChatOutputParser("auto", NAMES)
    assert p.feed("It is ", 1).content == "It is "
    assert p.feed("sunny. <tool", 1).content == "sunny. "  # "<tool" may start a call: held
    assert p.feed("_call>{", 1).content == ""
    p.feed('"name": "now", "arguments": {}}</tool_call>', 1)
    d = p.finish()
    assert d.calls == [("now", "{}")] and d.content == ""


def test_forced_parser():
    p = ChatOutputParser("forced", NAMES)
    for piece in splits('{"name": "add", "arguments": {"a": 1, "b": 2}}', 0):
        assert p.feed(piece, 1).content == ""
    assert p.finish().calls == [("add", json.dumps({"a": 1, "b": 2}))]
    cut = ChatOutputParser("forced", NAMES)
    cut.feed('{"name": "add", "argu', 1)
    d = cut.finish()
    assert d.calls is None and d.content == '{"name": "add", "argu'  # cut by max_tokens: the text, no call


# ---------------------------------------------------------------------------------------------------- reasoning


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("<think>Paris is in France.</think>\n\nIt is sunny.", "Paris is in France.", "It is sunny."),
        ("  <think>a</think>b", "a", "b"),
        ("No thinking here.", None, "No thinking here."),
        ("<think>cut off mid thought", "cut off mid thought", ""),
        ("<think></think>answer", "", "answer"),
        ("<thinking>is not the tag", None, "<thinking>is not the tag"),
        ("answer with </think> inside", None, "answer with </think> inside"),
        ("  ", None, "  "),
    ],
)
def test_split_reasoning(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)
    for seed in range(5):
        s = ReasoningStream()
        r = c = ""
        for piece in splits(text, seed):
            d = s.feed(piece, 1)
            r, c = r + d.reasoning, c + d.content
        d = s.finish()
        assert ((r + d.reasoning) if s.has_reasoning else None, c + d.content) == (reasoning, content)


def test_reasoning_tokens_count_the_think_part():
    s = ReasoningStream()
    tokens = ["<think>", "Paris", " is", " in", " France", ".", "</think>", "\n\n", "Sunny", "."]
    for t in tokens:
        s.feed(t, 1)
    s.finish()
    assert s.reasoning_tokens == 7  # <think> .. </think>, tags included
    s = ReasoningStream()
    for t in ["No", " think", "."]:
        s.feed(t, 1)
    assert s.reasoning_tokens == 0
    assert make_reasoning_stream(None) is None
    with pytest.raises(ValueError):
        make_reasoning_stream("r1")


# ---------------------------------------------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def tool_tokenizer():
    tok = load_tokenizer()
    tok.chat_template = TOOL_TEMPLATE
    return tok


def test_template_caps(tokenizer, tool_tokenizer):
    assert TemplateCaps.probe(tokenizer) == TemplateCaps(tools=False, content_lists=False)  # the demo ChatML template
    assert TemplateCaps.probe(tool_tokenizer) == TemplateCaps(tools=True, content_lists=True)


def chat_req(messages, **kw):
    return ChatCompletionRequest(model=MODEL, messages=messages, **kw)


def test_render_tools_into_system_message_without_template_support(tokenizer):
    fns = validate_tools(TOOLS)
    prompt = render_prompt(tokenizer, chat_req(MSGS), RenderOptions(functions=fns))
    plain = tokenizer.apply_chat_template(
        [{"role": "system", "content": tools_prompt(fns)}, *MSGS], add_generation_prompt=True, tokenize=False
    )
    assert prompt == plain
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    # an existing system message gets the tools appended
    sys_msgs = [{"role": "system", "content": "Be brief."}, *MSGS]
    prompt = render_prompt(tokenizer, chat_req(sys_msgs), RenderOptions(functions=fns))
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert prompt.count("<|im_start|>system") == 1


def test_render_tool_turns_without_template_support(tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "3"}]},
    ]
    prompt = render_prompt(tokenizer, chat_req(messages))
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
        in prompt
    )
    assert "<|im_start|>tool\n3<|im_end|>" in prompt


def test_render_with_template_tool_support(tool_tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "1+2"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "3"}, {"type": "text", "text": "!"}],
        },
    ]
    fns = validate_tools(TOOLS)
    prompt = render_prompt(tool_tokenizer, chat_req(messages), RenderOptions(functions=fns))
    assert prompt.startswith("<|im_start|>system\nTOOLS:get_weather;add;<|im_end|>")  # the template's own rendering
    assert "<tools>" not in prompt
    assert "<|im_start|>user\n[1+2][?]<|im_end|>" in prompt  # content lists passed through
    assert 'CALL add {"a": 1, "b": 2}' in prompt  # arguments as an object
    assert "<|im_start|>tool\n[3][!]<|im_end|>" in prompt
    # --flatten-tool-content: only the tool message becomes one string
    flat = render_prompt(tool_tokenizer, chat_req(messages), RenderOptions(functions=fns, flatten_tool_content=True))
    assert "<|im_start|>tool\n3\n!<|im_end|>" in flat and "[1+2][?]" in flat


def test_render_tool_message_with_non_text_parts_is_refused(tool_tokenizer):
    messages = [
        *MSGS,
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    ]
    with pytest.raises(InvalidRequestError, match="image"):
        render_prompt(tool_tokenizer, chat_req(messages), RenderOptions(flatten_tool_content=True))


# ---------------------------------------------------------------------------------------------------- HTTP (fake)


def make_client(tokenizer, **args):
    engine = FakeEngine(tokenizer, **args)
    return engine, TestClient(create_app(engine, manage_engine=False), raise_server_exceptions=False)


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSGS, **body})


@pytest.mark.parametrize(
    "patch, field, value",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": WEATHER["function"]["parameters"], "strict": True},
                }
            },
            "json_schema",
            json.dumps(WEATHER["function"]["parameters"]),
        ),
        ({"response_format": {"type": "json_object"}}, "json_schema", '{"type": "object"}'),
        ({"json_schema": {"type": "integer"}}, "json_schema", '{"type": "integer"}'),
        ({"json_schema": '{"type": "integer"}'}, "json_schema", '{"type": "integer"}'),
        ({"regex": r"\d{4}-\d{2}-\d{2}"}, "regex", r"\d{4}-\d{2}-\d{2}"),
        ({"ebnf": 'root ::= "yes" | "no"'}, "ebnf", 'root ::= "yes" | "no"'),
    ],
)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_constraints_reach_sampling_params(tokenizer, patch, field, value, endpoint):
    engine, client = make_client(tokenizer)
    if endpoint == "chat":
        r = chat(client, max_tokens=3, **patch)
    else:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, **patch})
    assert r.status_code == 200, r.text
    sp = engine.requests[0].sampling_params
    got = {k: getattr(sp, k) for k in ("json_schema", "regex", "ebnf")}
    assert got == {**{"json_schema": None, "regex": None, "ebnf": None}, field: value}


@pytest.mark.parametrize("fmt", [None, {"type": "text"}])
def test_text_response_format_is_unconstrained(tokenizer, fmt):
    engine, client = make_client(tokenizer)
    assert chat(client, max_tokens=2, response_format=fmt).status_code == 200
    sp = engine.requests[0].sampling_params
    assert sp.json_schema is None and sp.regex is None and sp.ebnf is None


@pytest.mark.parametrize(
    "fmt, param",
    [
        ("json", "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "name": 3}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict"),
        ({"type": "json_schema", "json_schema": []}, "response_format.json_schema"),
        ({"format": "json"}, "response_format.type"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_malformed_response_format_is_400(tokenizer, fmt, param, stream):
    engine, client = make_client(tokenizer)
    assert_error(chat(client, response_format=fmt, stream=stream), 400, param)
    assert engine.requests == []


def test_engine_grammar_error_is_400_even_when_streaming(tokenizer):
    engine, client = make_client(tokenizer)
    engine.fail_with = InvalidRequestError("invalid json_schema: bad", "json_schema")
    for stream in (False, True):
        assert_error(chat(client, response_format={"type": "json_object"}, stream=stream), 400, "invalid json_schema")


def test_required_tool_choice_constrains_and_returns_tool_calls(tokenizer):
    engine, client = make_client(tokenizer)
    engine.set_outputs(['{"name": "add", "arguments": {"a": 2, "b": 40}}'])
    r = chat(client, tools=TOOLS, tool_choice="required")
    assert r.status_code == 200, r.text
    fns = validate_tools(TOOLS)
    sp = engine.requests[0].sampling_params
    assert json.loads(sp.json_schema) == call_schema(fns, ToolChoice("required"))
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] is None and msg["role"] == "assistant"
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 40}
    # the tools were rendered into the prompt (the demo template has no tool support)
    want = tokenizer.apply_chat_template(
        [{"role": "system", "content": tools_prompt(fns)}, *MSGS], add_generation_prompt=True, tokenize=False
    )
    assert engine.requests[0].input_ids == tokenizer.encode(want, add_special_tokens=False)


def test_named_tool_choice_schema_and_n(tokenizer):
    engine, client = make_client(tokenizer)
    engine.set_outputs(
        [
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
            '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "fahrenheit"}}',
        ]
    )
    r = chat(client, tools=TOOLS, n=2, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.status_code == 200, r.text
    schema = json.loads(engine.requests[0].sampling_params.json_schema)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    cities = [json.loads(c["message"]["tool_calls"][0]["function"]["arguments"])["city"] for c in r.json()["choices"]]
    assert cities == ["Paris", "Oslo"]
    ids = [c["message"]["tool_calls"][0]["id"] for c in r.json()["choices"]]
    assert len(set(ids)) == 2


def test_forced_call_cut_by_length_is_text(tokenizer):
    engine, client = make_client(tokenizer)
    engine.set_outputs(['{"name": "add", "arguments": {"a": 2, "b": 40}}'])
    r = chat(client, tools=TOOLS, tool_choice="required", max_tokens=4)
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == tokenizer.decode(engine.outputs[0][:4])


def test_forced_tool_choice_with_response_format_is_400(tokenizer):
    engine, client = make_client(tokenizer)
    r = chat(client, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert_error(r, 400, "one output constraint")


# The tester's request (finding 1): answered 200 with the call as content and tool_calls null.
ARRAY_TOOL = {"type": "function", "function": {"name": "x", "parameters": ARRAY_PARAMS}}
FOO_TOOL = {"type": "function", "function": {"name": "x", "parameters": {"type": "foo"}}}


@pytest.mark.parametrize("tool", [ARRAY_TOOL, FOO_TOOL])
@pytest.mark.parametrize(
    "tool_choice", ["required", "auto", "none", None, {"type": "function", "function": {"name": "x"}}]
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tool_parameters_are_400_in_every_mode(tokenizer, tool, tool_choice, stream):
    # Regression (findings 1, 2): "required" with an array schema returned no call; {"type": "foo"} was accepted
    # with "auto" and named json_schema (a field the client never sent) when forced.
    engine, client = make_client(tokenizer)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 20, "stream": stream}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    r = client.post("/v1/chat/completions", json=body)
    assert assert_error(r, 400)["param"] == "tools[0].function.parameters"
    assert engine.requests == []


class _StubBackend:
    """Grammar backend whose compile fails for schemas containing ``needle``."""

    def __init__(self, needle: str):
        self.needle, self.compiled = needle, []

    async def get(self, kind, text):
        self.compiled.append(text)
        if self.needle in text:
            raise InvalidRequestError("invalid json_schema: unsupported", "json_schema")


@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_grammar_error_names_the_tool(tokenizer, stream):
    # Regression (finding 2): the engine's compile error of a forced call's schema named json_schema.
    engine, client = make_client(tokenizer)
    engine.fail_with = InvalidRequestError("invalid json_schema: Invalid range", "json_schema")
    named = {"type": "function", "function": {"name": "add"}}
    body = assert_error(chat(client, tools=TOOLS, tool_choice=named, stream=stream), 400)
    assert body["param"] == "tools[1].function.parameters" and "Invalid range" in body["message"]
    body = assert_error(chat(client, tools=[ADD], tool_choice="required", stream=stream), 400)
    assert body["param"] == "tools[0].function.parameters"
    # "required" over several tools: the one whose schema fails alone is named; none singled out: "tools"
    body = assert_error(chat(client, tools=TOOLS, tool_choice="required", stream=stream), 400)
    assert body["param"] == "tools"
    engine.grammar_backend = _StubBackend('"const": "add"')
    body = assert_error(chat(client, tools=TOOLS, tool_choice="required", stream=stream), 400)
    assert body["param"] == "tools[1].function.parameters"
    # other errors, and a response_format's grammar error, keep their labels
    body = assert_error(chat(client, response_format={"type": "json_object"}, stream=stream), 400)
    assert body["param"] == "json_schema"
    engine.fail_with = InvalidRequestError("queue full", None, status_code=429)
    assert_error(chat(client, tools=[ADD], tool_choice="required", stream=stream), 429)


@pytest.fixture(scope="module")
def grammar_backend(tokenizer):
    from radixserve.engine.grammar.xgrammar_backend import GrammarBackend

    backend = GrammarBackend(tokenizer, 49152, [2])
    yield backend
    backend.shutdown()


@pytest.mark.parametrize(
    "prop",
    [
        {"type": "string", "pattern": "(a"},  # structurally fine, refused by the grammar compiler
        {"type": "integer", "minimum": 5, "maximum": 1},
    ],
)
def test_forced_call_real_compile_error_names_the_tool(tokenizer, grammar_backend, prop):
    engine, client = make_client(tokenizer)
    engine.grammar_backend = grammar_backend
    plain_generate = engine.generate

    async def compiling_generate(req):  # as Engine.generate: the grammar is compiled before submission
        key = req.sampling_params.grammar_key()
        if key is not None:
            await grammar_backend.get(*key)
        async for out in plain_generate(req):
            yield out

    engine.generate = compiling_generate
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "properties": {"a": prop}}}}
    for tool_choice in ("required", {"type": "function", "function": {"name": "bad"}}):
        body = assert_error(chat(client, tools=[WEATHER, bad], tool_choice=tool_choice), 400)
        assert body["param"] == "tools[1].function.parameters", body
    engine.set_outputs(["It is sunny."])
    assert chat(client, tools=[WEATHER, bad], max_tokens=5).status_code == 200  # auto: nothing to compile


@pytest.mark.parametrize(
    "reply, content, calls",
    [
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
            None,
            [("get_weather", {"city": "Paris", "unit": "celsius"})],
        ),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        (
            'Checking. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>',
            "Checking.",
            [("add", {"a": 1, "b": 1})],
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_calls(tokenizer, reply, content, calls, stream):
    engine, client = make_client(tokenizer)
    engine.set_outputs([reply])
    r = chat(client, tools=TOOLS, stream=stream)  # tool_choice defaults to auto with tools
    assert r.status_code == 200, r.text
    sp = engine.requests[0].sampling_params
    assert sp.json_schema is None  # auto: unconstrained
    if stream:
        chunks = sse_payloads(r.text)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        got_content = "".join(d.get("content", "") for d in deltas) or None
        got_calls = [
            (t["function"]["name"], json.loads(t["function"]["arguments"]))
            for d in deltas
            for t in d.get("tool_calls", [])
        ]
        assert all(t["index"] == i for d in deltas for i, t in enumerate(d.get("tool_calls", [])))
        finish = chunks[-1]["choices"][0]["finish_reason"]
        if got_content is not None:
            got_content = got_content.strip() if calls else got_content
    else:
        msg = r.json()["choices"][0]["message"]
        got_content = msg["content"]
        got_calls = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in msg.get("tool_calls", [])]
        finish = r.json()["choices"][0]["finish_reason"]
    assert got_content == content and got_calls == calls
    assert finish == ("tool_calls" if calls else "stop")


def test_tool_choice_none_ignores_tools(tokenizer):
    engine, client = make_client(tokenizer)
    engine.set_outputs(['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'])
    r = chat(client, tools=TOOLS, tool_choice="none")
    msg = r.json()["choices"][0]["message"]
    assert "tool_calls" not in msg and msg["content"].startswith("<tool_call>")
    assert engine.requests[0].input_ids == tokenizer.encode(
        tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )  # tools not rendered


def test_tool_conversation_through_the_template(tokenizer):
    engine, client = make_client(tokenizer)
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 200, r.text
    text = tokenizer.decode(engine.requests[0].input_ids)
    assert "<|im_start|>tool\n3<|im_end|>" in text and '"arguments": {"a": 1, "b": 2}' in text


_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


def _with_call(fn):
    return [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [{**_CALL, "function": fn}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]


@pytest.mark.parametrize(
    "messages, param",
    [
        (
            [*MSGS, {"role": "assistant", "tool_calls": [_CALL]}, {"role": "tool", "content": "3"}],
            "messages[2].tool_call_id",
        ),
        (
            [
                *MSGS,
                {"role": "assistant", "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": None},
            ],
            "messages[2].content",
        ),
        (
            [*MSGS, {"role": "assistant", "tool_calls": [_CALL]}, {"role": "tool", "tool_call_id": "call_1"}],
            "messages[2].content",
        ),
        (_with_call({"name": "add"}), "messages[1].tool_calls[0].function.arguments"),
        (_with_call({"arguments": "{}"}), "messages[1].tool_calls[0].function.name"),
        (_with_call({"name": "", "arguments": "{}"}), "messages[1].tool_calls[0].function.name"),
        (_with_call({"name": "add", "arguments": "{'a': 1}"}), "messages[1].tool_calls[0].function.arguments"),
        (_with_call({"name": "add", "arguments": 3}), "messages[1].tool_calls[0].function.arguments"),
        (
            [*MSGS, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function"}]}],
            "messages[1].tool_calls[0].function",
        ),
    ],
)
@pytest.mark.parametrize("tools", [TOOLS, None])
def test_malformed_tool_messages_are_400(tokenizer, messages, param, tools):
    # Regression (finding 3): OpenAI answers these with a 400; we answered 200.
    engine, client = make_client(tokenizer)
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": tools, "max_tokens": 2})
    assert assert_error(r, 400)["param"] == param
    assert engine.requests == []


def test_well_formed_tool_messages_pass(tokenizer):
    engine, client = make_client(tokenizer)
    for fn in (
        {"name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "now", "arguments": "{}"},
    ):
        messages = _with_call(fn)
        messages[-1]["content"] = ""  # empty (not null) content is a result
        r = client.post("/v1/chat/completions", json={"messages": messages, "tools": [*TOOLS, NOARGS], "max_tokens": 2})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "legacy",
    [
        {"functions": [WEATHER["function"]]},
        {"functions": [WEATHER["function"]], "function_call": {"name": "get_weather"}},
        {"function_call": "auto"},
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_legacy_functions_fields_are_refused(tokenizer, legacy, stream):
    # Regression (finding 3): the deprecated functions/function_call were silently ignored (a 200 without calls).
    engine, client = make_client(tokenizer)
    body = assert_error(chat(client, stream=stream, **legacy), 400)
    first = "functions" if "functions" in legacy else "function_call"
    assert body["param"] == first and ("use tools" in body["message"] or "use tool_choice" in body["message"])
    assert engine.requests == []


def test_openai_client_parses_tool_call_stream(tokenizer):
    import openai

    engine = FakeEngine(tokenizer)
    engine.set_outputs(['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'])
    with ServerThread(create_app(engine, manage_engine=False)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        named = {"type": "function", "function": {"name": "get_weather"}}
        full = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=named)
        (call,) = full.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and full.choices[0].finish_reason == "tool_calls"
        with client.chat.completions.stream(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=named) as s:
            for _ in s:
                pass
            final = s.get_final_completion()
        (scall,) = final.choices[0].message.tool_calls
        assert scall.function.name == "get_weather" and scall.id.startswith("call_")
        assert json.loads(scall.function.arguments) == {"city": "Paris", "unit": "celsius"}
        assert final.choices[0].finish_reason == "tool_calls"
        # raw chunks too
        chunks = list(
            client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=named, stream=True)
        )
        tcs = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert len(tcs) == 1 and tcs[0].index == 0 and tcs[0].function.name == "get_weather"


# ---------------------------------------------------------------------------------------------------- switches


def test_default_chat_max_tokens_switch(tokenizer):
    engine, client = make_client(tokenizer)
    chat(client)
    room = engine.requests[0].sampling_params.max_new_tokens
    assert room > 1000  # off: all the room left in the 2048-token context
    engine, client = make_client(tokenizer, default_chat_max_tokens=7)
    chat(client)
    chat(client, max_tokens=3)
    assert [q.sampling_params.max_new_tokens for q in engine.requests] == [7, 3]
    engine, client = make_client(tokenizer, default_chat_max_tokens=10**6)
    chat(client)
    assert engine.requests[0].sampling_params.max_new_tokens == room  # clamped to the room left
    # completions keep OpenAI's 16
    client.post("/v1/completions", json={"prompt": "hi"})
    assert engine.requests[-1].sampling_params.max_new_tokens == 16


def test_tool_choice_as_auto_switch(tokenizer):
    reply = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    for as_auto in (False, True):
        engine, client = make_client(tokenizer, tool_choice_as_auto=as_auto)
        engine.set_outputs([reply if as_auto else '{"name": "add", "arguments": {"a": 1, "b": 1}}'])
        r = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
        sp = engine.requests[0].sampling_params
        assert (sp.json_schema is None) == as_auto
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "add"
        # unknown names are still refused
        assert_error(chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}), 400, "x")


def test_flatten_tool_content_switch(tool_tokenizer):
    messages = [
        *MSGS,
        {"role": "assistant", "content": "ok"},
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
    ]
    for flatten in (False, True):
        engine, client = make_client(tool_tokenizer, flatten_tool_content=flatten)
        assert client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).status_code == 200
        text = tool_tokenizer.decode(engine.requests[0].input_ids)
        assert ("<|im_start|>tool\na\nb<|im_end|>" in text) == flatten
        assert ("<|im_start|>tool\n[a][b]<|im_end|>" in text) == (not flatten)


def test_accept_bare_image_url_switch(tokenizer):
    bare = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": "https://example.com/cat.png"},
            ],
        }
    ]
    engine, client = make_client(tokenizer)
    body = assert_error(client.post("/v1/chat/completions", json={"messages": bare}), 400, "bare string")
    assert body["param"] == "messages[0].content[1].image_url"
    engine, client = make_client(tokenizer, accept_bare_image_url=True)
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={"messages": bare, "stream": stream})
        assert_error(r, 400, "model does not accept image input")
    assert engine.requests == []


def test_stream_error_preflight_switch(tokenizer, monkeypatch):
    for preflight in (False, True):
        engine, client = make_client(tokenizer, stream_error_preflight=preflight)
        orig = engine.generate

        async def aborting(req, orig=orig):
            async for out in orig(req):
                out.finish_reason = {"type": "abort", "matched": None, "message": "out of memory", "status_code": 503}
                yield out
                return

        monkeypatch.setattr(engine, "generate", aborting)
        for path, body in [("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "hi"})]:
            r = client.post(path, json={**body, "stream": True})
            if preflight:
                assert_error(r, 503, "out of memory")
            else:
                assert r.status_code == 200
                assert sse_payloads(r.text)[-1]["error"]["code"] == 503
    # with the switch on, normal streams are unchanged
    engine, client = make_client(tokenizer, stream_error_preflight=True)
    r = chat(client, max_tokens=6, stream=True, n=2)
    chunks = sse_payloads(r.text)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == 0)
    assert text == tokenizer.decode(engine.script_ids[:6])


THINK = "<think>The user greets me. I should answer.</think>\n\nHello! How can I help?"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_parser_switch(tokenizer, stream):
    n_think = len(tokenizer.encode("<think>The user greets me. I should answer.</think>", add_special_tokens=False))
    for parser in (None, "think"):
        engine, client = make_client(tokenizer, reasoning_parser=parser)
        engine.set_outputs([THINK])
        r = chat(client, stream=stream, stream_options={"include_usage": True} if stream else None)
        assert r.status_code == 200, r.text
        if stream:
            chunks = sse_payloads(r.text)
            deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
            reasoning = "".join(d.get("reasoning_content", "") for d in deltas) or None
            content = "".join(d.get("content", "") for d in deltas)
            usage = chunks[-1]["usage"]
        else:
            msg = r.json()["choices"][0]["message"]
            reasoning, content, usage = msg.get("reasoning_content"), msg["content"], r.json()["usage"]
        if parser is None:
            assert reasoning is None and content == THINK and "completion_tokens_details" not in usage
        else:
            assert reasoning == "The user greets me. I should answer." and content == "Hello! How can I help?"
            # the tokens of "<think>...</think>" (the fake emits one token per delta; the boundary token may
            # merge "</think>" with the newlines after it)
            assert abs(usage["completion_tokens_details"]["reasoning_tokens"] - n_think) <= 1
            assert usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]


def test_reasoning_then_tool_call(tokenizer):
    engine, client = make_client(tokenizer, reasoning_parser="think")
    engine.set_outputs(
        [
            '<think>Need the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Rome", "unit": "celsius"}}</tool_call>'
        ]
    )
    msg = chat(client, tools=TOOLS).json()["choices"][0]["message"]
    assert msg["reasoning_content"] == "Need the weather." and msg["content"] is None
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"


def test_switch_flags_parse():
    import argparse

    from radixserve.engine.config import EngineArgs, add_engine_args, engine_args_from_namespace

    p = argparse.ArgumentParser()
    add_engine_args(p)
    off = engine_args_from_namespace(p.parse_args([]))
    assert (
        off.default_chat_max_tokens,
        off.tool_choice_as_auto,
        off.flatten_tool_content,
        off.accept_bare_image_url,
        off.stream_error_preflight,
        off.reasoning_parser,
    ) == (None, False, False, False, False, None)
    on = engine_args_from_namespace(
        p.parse_args(
            [
                "--default-chat-max-tokens",
                "256",
                "--tool-choice-as-auto",
                "--flatten-tool-content",
                "--accept-bare-image-url",
                "--stream-error-preflight",
                "--reasoning-parser",
                "think",
            ]
        )
    )
    assert on == EngineArgs(
        default_chat_max_tokens=256,
        tool_choice_as_auto=True,
        flatten_tool_content=True,
        accept_bare_image_url=True,
        stream_error_preflight=True,
        reasoning_parser="think",
    )
    with pytest.raises(SystemExit):
        p.parse_args(["--reasoning-parser", "nope"])


# ---------------------------------------------------------------------------------------------------- real model


def _engine_accepts_constraints() -> bool:
    try:
        SamplingParams(json_schema='{"type": "object"}').validate(49152)
    except InvalidRequestError:
        return False
    return True


@pytest.fixture(scope="module")
def real_server():
    import httpx
    import torch

    from radixserve.engine.config import EngineArgs
    from radixserve.engine.engine import Engine

    from fake_engine import MODEL_DIR, wait_until

    if not _engine_accepts_constraints():
        pytest.skip("the engine does not accept output constraints yet")
    torch.set_num_threads(2)
    engine = Engine(EngineArgs(model_path=MODEL_DIR, context_length=2048, num_threads=2, max_total_tokens=8192))
    with ServerThread(create_app(engine)) as url:
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 200, timeout_s=300)
        yield url


@pytest.fixture(scope="module")
def oai(real_server):
    import openai

    return openai.OpenAI(base_url=real_server + "/v1", api_key="none", timeout=300, max_retries=0)


PROMPTS = [
    "What's the weather like in Paris?",
    "Please add 12 and 30.",
    "Is it cold in Oslo right now?",
    "Tell me a joke.",
]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_model_required_and_named_tool_calls_are_valid(oai):
    fns = {f["function"]["name"]: f["function"]["parameters"] for f in TOOLS}
    for i, prompt in enumerate(PROMPTS):
        for j, choice in enumerate(("required", {"type": "function", "function": {"name": "add"}})):
            for stream in [(i + j) % 2 == 1]:  # half of the requests streamed (2 cores: keep it short)
                kw = dict(
                    model=MODEL,
                    messages=[{"role": "user", "content": prompt}],
                    tools=TOOLS,
                    tool_choice=choice,
                    max_tokens=96,
                    temperature=0.7,
                    seed=i,
                )
                if stream:
                    with oai.chat.completions.stream(**kw) as s:
                        for _ in s:
                            pass
                        resp = s.get_final_completion()
                else:
                    resp = oai.chat.completions.create(**kw)
                c = resp.choices[0]
                assert c.finish_reason == "tool_calls", (prompt, choice, c)
                (call,) = c.message.tool_calls
                if isinstance(choice, dict):
                    assert call.function.name == "add"
                jsonschema.validate(json.loads(call.function.arguments), fns[call.function.name])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_model_response_formats_parse(oai):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        },
        "required": ["name", "age", "colors"],
        "additionalProperties": False,
    }
    for i, prompt in enumerate(["Describe a person as JSON.", "Give me a user profile."]):
        r = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=96,
            temperature=0.8,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": schema, "strict": True},
            },
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object."}],
        max_tokens=96,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = oai.completions.create(
        model=MODEL,
        prompt="Today's date is ",
        max_tokens=16,
        temperature=0.5,
        extra_body={"regex": r"\d{4}-\d{2}-\d{2}"},
    )
    import re

    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].text)
