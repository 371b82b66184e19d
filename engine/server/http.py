"""The engine's HTTP server: ``create_app(engine)`` builds the FastAPI app (OpenAI, native and operational routes).

Routes: ``POST /generate``, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{model}``, ``GET /health``, ``GET /health_generate``, ``GET /get_model_info``, ``POST /flush_cache``,
``POST /abort_request``, ``GET /metrics``, ``GET /get_tokenizer_files`` (for routers that key on token blocks). Every error is the OpenAI error body (``radixserve.protocol.error_body``):
validation errors are 400 (not FastAPI's 422), unexpected exceptions 500 without a traceback. A pure-ASGI middleware
assigns and echoes ``x-request-id``, enforces the request body limit (413) and the optional bearer API key (401).
The HTTP event loop never runs a model forward: the engine's scheduler thread does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve import constants
from radixserve.engine.io_struct import InvalidRequestError
from radixserve.engine.server.common import (
    REQUEST_ID_SCOPE_KEY,
    ServerContext,
    error_response,
    valid_request_id,
)
from radixserve.engine.server.generation import ClientDisconnected
from radixserve.engine.server.native import NativeServing
from radixserve.engine.server.openai_api import OpenAIServing
from radixserve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateReqInput,
    ModelCard,
    ModelList,
    error_body,
    random_id,
)

if TYPE_CHECKING:  # pragma: no cover
    from radixserve.engine.engine import Engine

logger = logging.getLogger("radixserve.engine.server")

# Probes and scrapes stay open when --api-key is set (Kubernetes and Prometheus carry no key).
_OPEN_PATHS = frozenset({constants.ENGINE_HEALTH_PATH, constants.ENGINE_HEALTH_GENERATE_PATH, "/metrics"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class EdgeMiddleware:
    """Pure-ASGI middleware at the edge of the app (no ``BaseHTTPMiddleware``, so streaming and disconnects pass).

    - ``x-request-id``: the client's (if printable ASCII, ≤ 128 chars) or a fresh one; stored in the scope for the
      handlers (it becomes the engine rid) and echoed on every response.
    - API key: with ``api_key`` set, every path but health and metrics needs ``Authorization: Bearer <key>`` (401).
    - Body limit: ``Content-Length`` or the body actually read over ``max_body_bytes`` → 413. The body is read here
      and replayed to the app; after it, ``receive`` passes through so disconnects are still seen.
    - Unhandled exceptions → 500 with the OpenAI error body (logged here, no traceback to the client).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        incoming = headers.get(constants.HEADER_REQUEST_ID)
        request_id = incoming if incoming is not None and valid_request_id(incoming) else random_id()
        scope[REQUEST_ID_SCOPE_KEY] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                raw = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                raw.append((constants.HEADER_REQUEST_ID.encode(), request_id.encode("latin-1")))
                message = {**message, "headers": raw}
            await send(message)

        async def reply(status: int, message: str) -> None:
            await error_response(message, status)(scope, receive, send_with_id)

        if self.api_key is not None and scope.get("path") not in _OPEN_PATHS:
            auth = headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
                await reply(401, "invalid or missing API key (Authorization: Bearer <key>)")
                return

        app_receive = receive
        if scope.get("method") in _BODY_METHODS:
            limit = self.max_body_bytes
            declared = headers.get("content-length")
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
            body = b"".join(chunks)
            replayed = False

            async def app_receive() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

        try:
            await self.app(scope, app_receive, send_with_id)
        except Exception:
            logger.exception("unhandled error on %s %s (request %s)", scope.get("method"), scope.get("path"),
                             request_id)
            if started:
                raise  # the response is under way; let the server drop the connection
            await reply(500, "internal server error")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if param is None and where:
            param = where
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


def create_app(engine: "Engine", manage_engine: bool = True) -> FastAPI:
    """The engine's FastAPI app.

    With ``manage_engine`` the app's lifespan starts the engine (``engine.start()`` in a worker thread, so ``/health``
    answers 503 while it warms up) and shuts it down on exit (Ctrl-C, SIGTERM). Pass False when the caller starts
    and stops the engine itself.
    """
    ctx = ServerContext.of(engine)
    openai = OpenAIServing(ctx)
    native = NativeServing(ctx)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        starter: asyncio.Task[None] | None = None
        if manage_engine:
            starter = asyncio.ensure_future(asyncio.to_thread(engine.start))
            starter.add_done_callback(_log_start_failure)
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(engine.shutdown)
                if starter is not None and not starter.done():
                    starter.cancel()

    app = FastAPI(title="radixserve engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.add_middleware(
        EdgeMiddleware, max_body_bytes=engine.args.max_request_body_bytes, api_key=engine.args.api_key
    )

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(InvalidRequestError)
    async def _on_invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(exc.message, exc.status_code, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def _on_error(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - the middleware
        logger.exception("unhandled error")  # catches first; kept for errors raised outside it
        return error_response("internal server error", 500)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await openai.chat(request, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await openai.completions(request, body)

    @app.post("/generate")
    async def generate(body: GenerateReqInput, request: Request) -> Response:
        return await native.generate(request, body)

    def model_card() -> ModelCard:
        return ModelCard(id=ctx.model_name, root=engine.args.model_path, max_model_len=ctx.context_length)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(ModelList(data=[model_card()]).model_dump())

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> JSONResponse:
        ctx.check_model(model)
        return JSONResponse(model_card().model_dump())

    @app.get(constants.ENGINE_HEALTH_PATH)
    async def health() -> Response:
        if engine.is_healthy():
            return Response(status_code=200)
        return error_response("the engine is not ready", 503)

    @app.get(constants.ENGINE_HEALTH_GENERATE_PATH)
    async def health_generate() -> Response:
        if engine.is_healthy() and await engine.health_generate():
            return Response(status_code=200)
        return error_response("the engine failed to generate", 503)

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        return JSONResponse(engine.model_info())

    @app.post("/flush_cache")
    async def flush_cache() -> Response:
        if await engine.flush_cache():
            return JSONResponse({"success": True, "message": "Cache flushed."})
        return error_response("cannot flush the cache while requests are running", 400)

    @app.post("/abort_request")
    async def abort_request(body: dict[str, Any]) -> Response:
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("rid must be a non-empty string", "rid")
        engine.abort(rid)
        return JSONResponse({"success": True})

    tokenizer_files: dict[str, str] = {}

    @app.get(constants.ENGINE_TOKENIZER_FILES_PATH)
    async def get_tokenizer_files() -> JSONResponse:
        if not tokenizer_files:
            tokenizer_files.update(await asyncio.to_thread(saved_tokenizer_files, engine.tokenizer))
        if not tokenizer_files:
            return error_response("this engine's tokenizer cannot be served as text files", 404)
        return JSONResponse({"model": ctx.model_name, "files": tokenizer_files})

    @app.get("/metrics")
    async def metrics() -> Response:
        content, content_type = engine.metrics.render()
        return Response(content=content, media_type=content_type)

    return app


def saved_tokenizer_files(tokenizer: Any) -> dict[str, str]:
    """The text files ``tokenizer.save_pretrained`` writes (tokenizer.json, tokenizer_config.json, chat template...),
    by file name, so a router can rebuild the same tokenizer and chat template without storing the model."""
    import os
    import tempfile

    files: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="radixserve-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        for name in sorted(os.listdir(tmp)):
            try:
                with open(os.path.join(tmp, name), encoding="utf-8") as f:
                    files[name] = f.read()
            except (UnicodeDecodeError, IsADirectoryError):  # a binary vocab (sentencepiece .model) cannot go in JSON
                logger.warning("tokenizer file %s is not text; routers fall back to character blocks", name)
                return {}
    return files


def _log_start_failure(task: "asyncio.Future[None]") -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine failed to start", exc_info=task.exception())
