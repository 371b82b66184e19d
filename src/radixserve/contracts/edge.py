"""The HTTP edge shared by the engine and the router: one pure-ASGI middleware for request ids, the API key, the
request body limit and last-resort 500s, all answered with the OpenAI error body.

Pure ASGI (no ``BaseHTTPMiddleware``), so streams and client disconnects pass through untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.contracts.json_body import parse_json_object
from radixserve.contracts.protocol import error_body, random_id

logger = logging.getLogger("radixserve.contracts.edge")

REQUEST_ID_SCOPE_KEY = "radixserve.request_id"  # the request id chosen here, for the handlers
BODY_SCOPE_KEY = "radixserve.body"  # the request body read here (bytes), for handlers that take it whole
MAX_REQUEST_ID_LEN = 128
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def valid_request_id(value: str | None) -> bool:
    """Whether a client's ``x-request-id`` can be used as is: printable ASCII, at most 128 characters."""
    return value is not None and 0 < len(value) <= MAX_REQUEST_ID_LEN and all(33 <= ord(c) < 127 for c in value)


class ErrorJSONResponse(JSONResponse):
    """A JSON error answer that always renders: a message quoting the client's text may hold a lone surrogate
    (``"model": "\\ud800"``), which UTF-8 cannot carry; it is then sent as its ``\\ud800`` escape (regression: the
    404 for that model was a 500)."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(
    message: str, status: int, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """A JSON response with the OpenAI error body and ``headers``; a 429 or 503 says ``Retry-After: 1`` (seconds)
    unless ``headers`` give one, so a client (or the router) knows the refusal is temporary and when to retry."""
    out = dict(headers or {})
    if status in (429, 503):
        out.setdefault("retry-after", "1")
    return ErrorJSONResponse(error_body(message, status, param), status_code=status, headers=out)


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's HTTP errors (404 unknown path, 405 wrong method, ...) with the OpenAI error body and the
    exception's headers (e.g. ``Allow`` on a 405). Install with
    ``app.add_exception_handler(StarletteHTTPException, http_exception_handler)``."""
    assert isinstance(exc, StarletteHTTPException)
    message = str(exc.detail)
    raw = request.scope.get(BODY_SCOPE_KEY)
    if exc.status_code == 400 and isinstance(raw, bytes):
        # FastAPI's "There was an error parsing the body" (invalid UTF-8, JSON nested too deeply): say what.
        parsed = parse_json_object(raw)
        message = parsed if isinstance(parsed, str) else message
    return ErrorJSONResponse(error_body(message, exc.status_code), status_code=exc.status_code, headers=exc.headers)


class EdgeMiddleware:
    """Pure-ASGI middleware at the edge (no ``BaseHTTPMiddleware``, so streams and disconnects pass through).

    - ``x-request-id``: the client's (printable ASCII, ≤ 128 chars) or a fresh one; stored in the scope (the proxy
      sends it upstream, the engine makes it the request id) and echoed on every response, replacing an upstream copy.
    - API key: with ``api_key`` set, every path but ``open_paths`` (probes and scrapes: Kubernetes and Prometheus
      carry no key) needs ``Authorization: Bearer <key>`` (401; the scheme is case-insensitive).
    - Body limit: ``Content-Length`` or the body read over ``max_body_bytes`` → 413. The body is read here, stored
      in the scope (``BODY_SCOPE_KEY``) and replayed to the app; after it ``receive`` passes through (disconnects
      are still seen).
    - ``on_reply(status)``, if given, is called for each error answered here (e.g. to count it).
    - Unhandled exceptions → 500 with the OpenAI error body (logged, no traceback to the client).
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        api_key: str | None,
        open_paths: Collection[str],
        on_reply: Callable[[int], None] | None = None,
    ):
        self.app = app
        self.open_paths = frozenset(open_paths)
        self.max_body_bytes = max_body_bytes
        self.expected_key = api_key.encode() if api_key is not None else None
        self.on_reply = on_reply  # counts the 401/413/500 answered here (requests_total{model="unknown"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = auth = declared = None
        for k, v in scope.get("headers", ()):
            k = k.lower()
            if k == b"x-request-id":
                incoming = v.decode("latin-1")
            elif k == b"authorization":
                auth = v
            elif k == b"content-length":
                declared = v.decode("latin-1")
        request_id = incoming if incoming is not None and valid_request_id(incoming) else random_id()
        scope[REQUEST_ID_SCOPE_KEY] = request_id
        rid_header = (b"x-request-id", request_id.encode("latin-1"))
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                raw = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                raw.append(rid_header)
                message = {**message, "headers": raw}
            await send(message)

        async def reply(status: int, message: str) -> None:
            await error_response(message, status)(scope, receive, send_with_id)
            if self.on_reply is not None:
                self.on_reply(status)

        if self.expected_key is not None and scope.get("path") not in self.open_paths:
            scheme, _, token = (auth or b"").partition(b" ")
            # The auth scheme is case-insensitive (RFC 9110 §11.1): "bearer k" is as good as "Bearer k".
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected_key):
                await reply(401, "invalid or missing API key (Authorization: Bearer <key>)")
                return

        app_receive = receive
        if scope.get("method") in _BODY_METHODS:
            limit = self.max_body_bytes
            if declared is not None and declared.isdigit() and int(declared) > limit:
                await reply(413, f"request body of {declared} bytes is over the limit of {limit} bytes")
                return
            chunks: list[bytes] = []
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                if size > limit:
                    await reply(413, f"request body is over the limit of {limit} bytes")
                    return
                if not message.get("more_body", False):
                    break
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            scope[BODY_SCOPE_KEY] = body
            replayed = False

            async def replay_receive() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            app_receive = replay_receive

        try:
            await self.app(scope, app_receive, send_with_id)
        except Exception:
            logger.exception(
                "unhandled error on %s %s (request %s)", scope.get("method"), scope.get("path"), request_id
            )
            if started:
                raise  # the response is under way; let the server drop the connection
            await reply(500, "internal server error")
