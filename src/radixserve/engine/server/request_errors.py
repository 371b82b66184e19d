"""The 400 for a request FastAPI could not validate: a readable message and ``param``, the request field at fault.

Bodies that are not a JSON object get the router's message word for word (``radixserve.contracts.json_body``); field
errors name the field as OpenAI does, ``messages[0].content``, never pydantic's union member tags
(``content.list[ContentPart]``) nor FastAPI's character offset (regression: ``param: "33"`` for broken JSON).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError

from radixserve.contracts.json_body import CONTENT_TYPE_MESSAGE, parse_json_object

MAX_REPORTED_ERRORS = 5
_REQUEST_PARTS = frozenset({"body", "query", "path", "header", "cookie"})  # FastAPI's first loc element
# Pydantic names a union member in ``loc`` by its type: ``str``, ``list[ContentPart]``, ``ChatMessage``,
# ``function-after[...]``. Field names here are snake_case, so these cannot be one.
_BUILTIN_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "dict", "list", "none"})
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")


def field_path(loc: Sequence[int | str]) -> str:
    """The request field a pydantic error ``loc`` points at, as OpenAI writes it: ``("body", "messages", 0,
    "content", "str")`` → ``messages[0].content``; "" for the body itself."""
    if loc and loc[0] in _REQUEST_PARTS:
        loc = loc[1:]
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _FIELD_NAME.fullmatch(part) and part not in _BUILTIN_TAGS:
            path += f".{part}" if path else part
        # else: a union member's tag or a dict-key marker ("[key]"), not a field
    return path


def validation_error(exc: RequestValidationError, raw: bytes | None) -> tuple[str, str | None]:
    """``(message, param)`` of the 400 for ``exc``, raised on a request whose body is ``raw`` (None without one).

    A body that is not a JSON object says so with null ``param`` (where broken JSON breaks, by line and column).
    Otherwise the first ``MAX_REPORTED_ERRORS`` field errors, ``path: msg`` joined by ``; `` (one field's failed
    union members joined by `` or ``), and ``param`` the first error's field path (null for the body itself).
    """
    errors: list[dict[str, Any]] = list(exc.errors())
    broken = bool(errors) and errors[0].get("type") == "json_invalid"  # its loc ends in a character offset
    if broken or not errors or field_path(errors[0].get("loc", ())) == "":
        parsed = parse_json_object(raw) if raw is not None else None
        if isinstance(parsed, str):
            return parsed, None
        if broken:
            return f"the request body is not valid JSON: {(errors[0].get('ctx') or {}).get('error')}", None
        if errors and errors[0].get("type") in ("model_attributes_type", "dict_type"):
            # A JSON object FastAPI did not read: sent without Content-Type application/json (``curl -d`` sends
            # application/x-www-form-urlencoded).
            return CONTENT_TYPE_MESSAGE, None
    messages: dict[str, list[str]] = {}  # field path → its errors, in order
    for err in errors:
        where = field_path(err.get("loc", ()))
        if where not in messages and len(messages) == MAX_REPORTED_ERRORS:
            break
        msgs = messages.setdefault(where, [])
        if str(err.get("msg")) not in msgs:
            msgs.append(str(err.get("msg")))
    parts = [f"{where}: {' or '.join(msgs)}" if where else " or ".join(msgs) for where, msgs in messages.items()]
    param = next((where for where in messages if where), None)
    return "; ".join(parts) or "invalid request", param
