"""OpenAI request fields → the engine's ``SamplingParams``: the defaults, ``logit_bias`` and the one output
constraint (which parameters are honoured at all is ``openai_params.py``).

Constraints: ``response_format`` ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` becomes the
engine's ``json_schema`` (the schema as JSON text), ``{"type": "json_object"}`` the schema ``{"type": "object"}``,
``{"type": "text"}`` nothing; SGLang's extra keys ``json_schema``, ``regex``, ``ebnf`` pass through; a forced
``tool_choice`` (``required`` or named) becomes the call's JSON schema (``tools.py``). At most one of them per
request; the engine refuses invalid grammars with a 400 before any output.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.engine.io_struct import InvalidRequestError, SamplingParams
from radixserve.engine.server.context import ServerContext
from radixserve.engine.server.openai_params import OpenAIRequest

JSON_OBJECT_SCHEMA = json.dumps({"type": "object"})  # response_format {"type": "json_object"}


def response_format_schema(fmt: Any) -> str | None:
    """The engine ``json_schema`` (JSON text) for an OpenAI ``response_format``; None for ``text`` or absent.

    Raises ``InvalidRequestError`` (400, naming the field) for a malformed ``response_format``.
    """
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequestError("response_format must be an object", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequestError(
                'response_format.json_schema must be an object {"name", "schema", "strict"}',
                "response_format.json_schema",
            )
        schema = js.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format.json_schema.schema must be a JSON schema object", "response_format.json_schema.schema"
            )
        if js.get("name") is not None and not isinstance(js["name"], str):
            raise InvalidRequestError(
                "response_format.json_schema.name must be a string", "response_format.json_schema.name"
            )
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise InvalidRequestError(
                "response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict"
            )
        return json.dumps(schema)  # always enforced (strict or not): decoding is constrained to the schema
    raise InvalidRequestError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format.type"
    )


def output_constraint(req: OpenAIRequest, forced_call: dict[str, Any] | None = None) -> dict[str, str | None]:
    """The one constraint of a request as SamplingParams fields ``{"json_schema", "regex", "ebnf"}`` (all None
    without one). ``forced_call``: a forced tool call's JSON schema.

    Raises ``InvalidRequestError`` (400) for a malformed one or more than one (naming the second)."""
    found: dict[str, tuple[str, str]] = {}
    if forced_call is not None:
        found["tool_choice"] = ("json_schema", json.dumps(forced_call))
    fmt = response_format_schema(req.response_format)
    if fmt is not None:
        found["response_format"] = ("json_schema", fmt)
    if req.json_schema is not None:
        if isinstance(req.json_schema, dict):
            found["json_schema"] = ("json_schema", json.dumps(req.json_schema))
        elif isinstance(req.json_schema, str):
            found["json_schema"] = ("json_schema", req.json_schema)
        else:
            raise InvalidRequestError("json_schema must be a JSON schema object or its JSON text", "json_schema")
    for kind in ("regex", "ebnf"):
        value = getattr(req, kind)
        if value is not None:
            if not isinstance(value, str):  # pragma: no cover - the model types it
                raise InvalidRequestError(f"{kind} must be a string", kind)
            found[kind] = (kind, value)
    if len(found) > 1:
        names = list(found)
        raise InvalidRequestError(f"only one output constraint per request; got {' and '.join(names)}", names[1])
    out: dict[str, str | None] = {"json_schema": None, "regex": None, "ebnf": None}
    for kind, text in found.values():
        out[kind] = text
    return out


def sampling_params(
    ctx: ServerContext, req: OpenAIRequest, forced_call: dict[str, Any] | None = None
) -> SamplingParams:
    """SamplingParams of an OpenAI request: its fields, else the engine's ``--preferred-sampling-params``, else
    OpenAI's defaults. ``max_new_tokens`` is None: set once the prompt length is known (``resolve_max_tokens``).

    Raises ``InvalidRequestError`` (400, naming the field) for a value out of range (``logit_bias``: a key that is
    not a token id, a bias outside [-100, 100]) or more than one constraint."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    defaults = ctx.engine.sampling_defaults
    _check_min_tokens(req)

    def pick(value: Any, name: str, default: Any) -> Any:
        return defaults.get(name, default) if value is None else value

    sp = SamplingParams(
        max_new_tokens=None,
        temperature=pick(req.temperature, "temperature", 1.0),
        top_p=pick(req.top_p, "top_p", 1.0),
        top_k=pick(req.top_k, "top_k", -1),
        min_p=pick(req.min_p, "min_p", 0.0),
        presence_penalty=pick(req.presence_penalty, "presence_penalty", 0.0),
        frequency_penalty=pick(req.frequency_penalty, "frequency_penalty", 0.0),
        repetition_penalty=pick(req.repetition_penalty, "repetition_penalty", 1.0),
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        min_new_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        n=req.n,
        **output_constraint(req, forced_call),
        no_stop_trim=req.no_stop_trim,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=req.logit_bias or None,
    )
    sp.validate(ctx.engine.vocab_size)
    return sp


def _check_min_tokens(req: OpenAIRequest) -> None:
    """``min_tokens`` (vLLM's) is an integer >= 0 and at most the request's own ``max_completion_tokens`` or
    ``max_tokens`` when given and valid (a limit from the context length only cuts the output short: ``length``;
    a negative max is its own 400). Raises ``InvalidRequestError`` (400, ``min_tokens``)."""
    if req.min_tokens < 0:
        raise InvalidRequestError(f"min_tokens must be an integer >= 0, got {req.min_tokens}", "min_tokens")
    requested = getattr(req, "max_completion_tokens", None)
    name = "max_completion_tokens"
    if requested is None:
        requested, name = req.max_tokens, "max_tokens"
    if isinstance(requested, int) and not isinstance(requested, bool) and 0 <= requested < req.min_tokens:
        raise InvalidRequestError(f"min_tokens ({req.min_tokens}) must be at most {name} ({requested})", "min_tokens")
