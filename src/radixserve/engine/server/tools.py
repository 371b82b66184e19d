"""OpenAI tool calling on chat: validating ``tools``/``tool_choice``, the constraint for forced calls, rendering tool
definitions for templates without tool support (parsing calls out of the model's text: ``tool_parser.py``).

Formats (after SGLang's ``function_call`` parsers and vLLM's ``hermes`` tool parser; the same as Qwen2.5's and
NousResearch Hermes 2 Pro's chat templates):

* **Tool definitions** for a chat template that does not render ``tools`` (rendering with ``tools=`` gives the same
  text as without) are appended to the system message (a system message is added when there is none) as
  ``TOOLS_PROMPT``: one JSON object per line, ``{"type": "function", "function": {"name", "description",
  "parameters"}}``, inside ``<tools></tools>``, followed by the call format below. Past assistant ``tool_calls``
  become ``<tool_call>`` blocks in that assistant message's text; ``role: "tool"`` messages stay role ``tool``.
* **A call** in the model's text (``tool_choice: "auto"``) is ``<tool_call>{"name": NAME, "arguments": {...}}
  </tool_call>`` (several blocks: several calls; a missing closing tag at the end of the text is tolerated;
  ``"parameters"`` is accepted for ``"arguments"``), or the whole reply being such a JSON object (or a JSON list
  of them), optionally in a ```` ```json ```` fence. Only names of the request's tools count; if any block does not
  parse, the whole reply is plain text. Text outside the blocks is the message ``content`` (null if blank).
* **Forced calls** (``"required"``, or ``{"type": "function", "function": {"name": NAME}}``) constrain decoding with
  ``call_schema``: the reply is exactly one JSON object ``{"name": NAME, "arguments": {...}}`` whose arguments
  match the function's ``parameters`` schema (``anyOf`` over the tools for ``"required"`` with several tools).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.engine.io_struct import InvalidRequestError

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class ToolChoice:
    """The resolved ``tool_choice``: ``mode`` is ``none`` (tools ignored), ``auto`` (the model may call; calls
    parsed from text), ``required`` (one call to any tool, constrained) or ``named`` (one call to ``name``).
    ``allowed``: OpenAI's ``allowed_tools``, the names the model is offered and may call (None: every tool)."""

    mode: str
    name: str | None = None
    allowed: frozenset[str] | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def offered(self, functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The functions shown to the model and callable: ``allowed`` ones only, in the request's order."""
        return functions if self.allowed is None else [f for f in functions if f["name"] in self.allowed]


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """Check ``tools`` and return the function definitions ``[{"name", "description"?, "parameters"?}]``.

    Raises ``InvalidRequestError`` (400, naming the field) unless ``tools`` is a list of ``{"type": "function",
    "function": {"name": str, "description"?: str, "parameters"?: object}}`` with distinct valid names, each
    ``parameters`` an object-type JSON schema (``check_parameters``).
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of function tools", "tools")
    functions: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequestError(f'{where} must be a function tool {{"type": "function", ...}}', where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise InvalidRequestError(
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                f"{where}.function.name",
            )
        if name in seen:
            raise InvalidRequestError(f"duplicate tool name {name!r}", f"{where}.function.name")
        seen.add(name)
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            raise InvalidRequestError(f"{where}.function.description must be a string", f"{where}.function.description")
        params = fn.get("parameters")
        if params is not None:
            check_parameters(params, f"{where}.function.parameters")
        out: dict[str, Any] = {"name": name}
        if fn.get("description") is not None:
            out["description"] = fn["description"]
        if params is not None:
            out["parameters"] = params
        functions.append(out)
    return functions


_TYPES = {"string", "number", "integer", "boolean", "object", "array", "null"}
_SUBSCHEMA = (
    "additionalProperties",
    "additionalItems",
    "items",
    "not",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COUNTS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
_NUMBERS = ("minimum", "maximum", "multipleOf")


def _check_schema(schema: Any, path: str, param: str) -> None:
    """Structural JSON Schema check of ``schema`` at ``path`` (every keyword we know has the right JSON shape)."""

    def bad(what: str) -> InvalidRequestError:
        return InvalidRequestError(f"invalid schema in {param}: {path} {what}", param)

    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad(f"must be a JSON schema (an object or a boolean), got {type(schema).__name__}")
    typ = schema.get("type")
    if typ is not None:
        types = typ if isinstance(typ, list) else [typ]
        if not types or not all(isinstance(t, str) and t in _TYPES for t in types) or len(set(types)) != len(types):
            raise bad(f"has an invalid type {typ!r}; use one or a list of {sorted(_TYPES)}")
    for key in _SUBSCHEMA:
        if key in schema:
            value = schema[key]
            if key == "items" and isinstance(value, list):  # draft-04 tuple form
                for j, sub in enumerate(value):
                    _check_schema(sub, f"{path}.items[{j}]", param)
            else:
                _check_schema(value, f"{path}.{key}", param)
    for key in _SCHEMA_LISTS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, list) or not value:
                raise bad(f"{key} must be a non-empty list of schemas")
            for j, sub in enumerate(value):
                _check_schema(sub, f"{path}.{key}[{j}]", param)
    for key in _SCHEMA_MAPS:
        if key in schema:
            value = schema[key]
            if not isinstance(value, dict):
                raise bad(f"{key} must be an object of schemas")
            for name, sub in value.items():
                _check_schema(sub, f"{path}.{key}.{name}", param)
    if "required" in schema:
        req = schema["required"]
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
            raise bad("required must be a list of property names")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise bad("enum must be a list")
    if "pattern" in schema and not isinstance(schema["pattern"], str):
        raise bad("pattern must be a string")
    for key in _COUNTS:
        if key in schema:
            v = schema[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(f"{key} must be a non-negative integer, got {v!r}")
    for key in _NUMBERS + ("exclusiveMinimum", "exclusiveMaximum"):
        if key in schema:
            v = schema[key]
            ok_bool = key.startswith("exclusive")  # draft-04: a boolean modifier of minimum/maximum
            if isinstance(v, bool) and not ok_bool or not isinstance(v, (int, float)):
                raise bad(f"{key} must be a number, got {v!r}")
    if "multipleOf" in schema and not schema["multipleOf"] > 0:
        raise bad("multipleOf must be greater than 0")


def check_parameters(params: Any, param: str) -> None:
    """Check one tool's ``parameters``: a JSON schema of ``"type": "object"`` (OpenAI's rule: arguments are a JSON
    object; ``type`` may be left out, the object type is then implied), structurally valid (known types, keywords
    of the right JSON shape, recursively).

    Raises ``InvalidRequestError`` (400, ``param``) otherwise. Checked in every ``tool_choice`` mode: a schema that
    is only caught when a call is forced would be accepted or refused depending on the mode.
    """
    if not isinstance(params, dict):
        raise InvalidRequestError(f"{param} must be a JSON schema object, got {type(params).__name__}", param)
    if "type" in params and params["type"] != "object":
        raise InvalidRequestError(
            f'{param} must be a JSON schema of type "object" (the arguments are a JSON object), '
            f"got type {params['type']!r}",
            param,
        )
    _check_schema(params, "parameters", param)


def resolve_tool_choice(functions: list[dict[str, Any]], tool_choice: Any, as_auto: bool = False) -> ToolChoice:
    """The effective ``ToolChoice`` (OpenAI's default: ``auto`` with tools, ``none`` without).

    ``as_auto`` (``--tool-choice-as-auto``) serves ``required`` and named choices as ``auto``. Raises
    ``InvalidRequestError`` (400) for an unknown choice, a choice other than ``none`` without tools, or a named
    function that is not among the tools.
    """
    if tool_choice is None:
        return ToolChoice("auto" if functions else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}", "tool_choice"
            )
        choice = ToolChoice(tool_choice)
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        choice = _allowed_tools(functions, tool_choice.get("allowed_tools"))
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequestError(
                'a named tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice"
            )
        choice = ToolChoice("named", fn["name"])
    else:
        raise InvalidRequestError("tool_choice must be a string or an object", "tool_choice")
    if choice.mode != "none" and not functions:
        raise InvalidRequestError("tool_choice is set but no tools were given", "tool_choice")
    if choice.mode == "named" and choice.name not in {f["name"] for f in functions}:
        raise InvalidRequestError(f"tool_choice names an unknown tool {choice.name!r}", "tool_choice.function.name")
    if as_auto and choice.forced:
        return ToolChoice("auto", allowed=choice.allowed)
    return choice


def _allowed_tools(functions: list[dict[str, Any]], spec: Any) -> ToolChoice:
    """OpenAI's ``{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [{"type":
    "function", "function": {"name": ...}}]}}``: ``mode`` over the listed tools only. 400s name the field."""
    where = "tool_choice.allowed_tools"
    if not isinstance(spec, dict):
        raise InvalidRequestError(f'{where} must be an object {{"mode", "tools"}}', where)
    mode = spec.get("mode")
    if mode not in ("auto", "required"):
        raise InvalidRequestError(f"{where}.mode must be 'auto' or 'required', got {mode!r}", f"{where}.mode")
    tools = spec.get("tools")
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError(f"{where}.tools must be a non-empty list of tools", f"{where}.tools")
    known = {f["name"] for f in functions}
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequestError(
                f'{where}.tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', f"{where}.tools[{i}]"
            )
        if name not in known:
            raise InvalidRequestError(f"{where}.tools[{i}] names an unknown tool {name!r}", f"{where}.tools[{i}]")
        names.add(name)
    return ToolChoice(mode, allowed=frozenset(names))


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    # OpenAI: omitted parameters = a function taking no arguments. A schema without "type" is an object schema
    # (validate_tools refuses any other type): the type is made explicit so the constrained call's arguments are an
    # object, which parse_forced_call requires.
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return params if "type" in params else {**params, "type": "object"}


def _call_object(fn: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": _parameters(fn)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def call_schema(functions: list[dict[str, Any]], choice: ToolChoice) -> dict[str, Any]:
    """JSON schema of one forced call ``{"name": ..., "arguments": {...}}``: the named function, or for ``required``
    the only tool or an ``anyOf`` of one object per tool (so each name goes with its own arguments' schema)."""
    if choice.mode == "named":
        return _call_object(next(f for f in functions if f["name"] == choice.name))
    if choice.mode != "required":
        raise ValueError(f"no call schema for tool_choice mode {choice.mode!r}")
    if len(functions) == 1:
        return _call_object(functions[0])
    return {"anyOf": [_call_object(f) for f in functions]}


def tools_prompt(functions: list[dict[str, Any]]) -> str:
    """``TOOLS_PROMPT`` filled with the tool definitions (one JSON object per line)."""
    lines = [json.dumps({"type": "function", "function": fn}, ensure_ascii=False) for fn in functions]
    return TOOLS_PROMPT.format(tools="\n".join(lines))


def render_call_text(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant turn's ``tool_calls`` as ``<tool_call>`` blocks (for templates that do not render them).

    ``arguments`` given as JSON text is embedded as the object it encodes."""
    blocks = []
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            continue
        args: Any = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        blocks.append(
            f"{TOOL_CALL_START}\n{json.dumps({'name': fn.get('name'), 'arguments': args}, ensure_ascii=False)}\n"
            f"{TOOL_CALL_END}"
        )
    return "\n".join(blocks)


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id ``call_<24 hex digits>``."""
    return "call_" + uuid.uuid4().hex[:24]
