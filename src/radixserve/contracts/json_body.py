"""A request's JSON body, read the same way by the engine and the router: the JSON object, or the message of the 400
that says what is wrong with it (where the JSON breaks, an empty body, a body that is not an object)."""

from __future__ import annotations

import json
from typing import Any

EMPTY_BODY_MESSAGE = "the request body is empty; a JSON object is expected"
NOT_AN_OBJECT_MESSAGE = "the request body must be a JSON object"


def parse_json_object(raw: bytes) -> dict[str, Any] | str:
    """The JSON object in ``raw``, or the message of the 400 to answer (the error's ``param`` is then null).

    ``raw`` is UTF-8 (or UTF-16/32 with a BOM, as ``json.loads`` detects). Broken JSON names where it breaks, 1-based
    as editors count: ``the request body is not valid JSON at line 1 column 34: Expecting ',' delimiter`` (regression:
    the engine answered ``33: JSON decode error`` with ``param: "33"``, FastAPI's character offset).
    """
    if not raw.strip():
        return EMPTY_BODY_MESSAGE
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as e:
        return f"the request body is not valid JSON at line {e.lineno} column {e.colno}: {e.msg}"
    except UnicodeDecodeError as e:
        return f"the request body is not valid UTF-8 (byte {e.start}): a JSON object is expected"
    except RecursionError:
        return "the request body nests JSON too deeply"
    if not isinstance(body, dict):
        return NOT_AN_OBJECT_MESSAGE
    return body
