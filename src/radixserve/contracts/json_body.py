"""A request's JSON body, read the same way by the engine and the router: the JSON object, or the message of the 400
that says what is wrong with it (where the JSON breaks, an empty body, a body that is not an object, a JSON object
sent without a JSON Content-Type)."""

from __future__ import annotations

import email.message
import json
from typing import Any

EMPTY_BODY_MESSAGE = "the request body is empty; a JSON object is expected"
NOT_AN_OBJECT_MESSAGE = "the request body must be a JSON object"
# A JSON object sent as something else, e.g. by `curl -d` (application/x-www-form-urlencoded).
CONTENT_TYPE_MESSAGE = "the request body must be sent with Content-Type: application/json"


def is_json_content_type(value: str | None) -> bool:
    """Whether a ``Content-Type`` header value announces JSON as the engine's FastAPI reads it: ``application/json``
    or ``application/*+json``, any case, parameters (``; charset=utf-8``) allowed; no header or an empty one is not
    JSON (FastAPI's ``strict_content_type``, the default)."""
    if value == "application/json":
        return True  # what nearly every client sends: no parsing
    if not value:
        return False
    header = email.message.Message()
    header["content-type"] = value
    subtype = header.get_content_subtype()
    return header.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


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
    except ValueError:  # after its subclasses above: Python's 4,300-digit limit on int() (regression: a 500)
        return "the request body holds an integer too long to read (over 4,300 digits)"
    if not isinstance(body, dict):
        return NOT_AN_OBJECT_MESSAGE
    return body
