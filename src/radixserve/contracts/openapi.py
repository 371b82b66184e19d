"""The OpenAPI schema the engine and the router serve at ``GET /openapi.json`` (for clients, schema checkers and the
fuzz tests): FastAPI's, with the error answers as they really are, and with the router's proxied routes described.

FastAPI documents a 422 ``HTTPValidationError`` on every route that takes input; neither server ever answers one
(docs/contracts.md, "Errors": bad input is a 400 with the OpenAI error body), so the schema says 400 and that body.
The router's ``POST`` routes are raw ASGI apps FastAPI cannot see; ``extra_posts`` gives each its request model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

OPENAPI_PATH = "/openapi.json"
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_ERROR_SCHEMAS: dict[str, Any] = {
    "ErrorResponse": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"$ref": "#/components/schemas/ErrorInfo"}},
    },
    "ErrorInfo": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "code": {"type": "integer"},
        },
    },
}


def _post_route(path: str, model: type[BaseModel]) -> APIRoute:
    """A route FastAPI can document (never served): ``POST path`` with a JSON body of ``model``."""

    async def endpoint(body: Any) -> Any:  # pragma: no cover - documentation only
        return body

    endpoint.__annotations__ = {"body": model, "return": Any}
    name = path.strip("/").replace("/", "_") or "root"
    return APIRoute(path, endpoint, methods=["POST"], name=name, response_model=None)


def build_schema(app: FastAPI, extra_posts: Mapping[str, type[BaseModel]] | None = None) -> dict[str, Any]:
    """``app``'s OpenAPI document plus ``extra_posts`` (path → request model), errors documented as the servers
    answer them: a 400 with the OpenAI error body where FastAPI would say 422."""
    routes = list(app.routes) + [_post_route(p, m) for p, m in (extra_posts or {}).items()]
    schema = get_openapi(title=app.title, version=app.version, routes=routes)
    for item in schema.get("paths", {}).values():
        for operation in item.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses["400"] = {
                    "description": "Bad request (OpenAI error body)",
                    "content": {"application/json": {"schema": _ERROR_REF}},
                }
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    components.update(_ERROR_SCHEMAS)
    return schema


def install(app: FastAPI, extra_posts: Mapping[str, type[BaseModel]] | None = None) -> None:
    """Serve ``build_schema(app, extra_posts)`` at ``app.openapi_url`` (built once, on the first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_schema(app, extra_posts)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
