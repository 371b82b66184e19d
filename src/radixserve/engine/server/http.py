"""The engine's HTTP server: ``create_app(engine)`` builds the FastAPI app (OpenAI, native and operational routes).

Routes: ``POST /generate``, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{model}``, ``GET /health``, ``GET /health_generate``, ``GET /get_model_info``, ``POST /flush_cache``,
``POST /abort_request``, ``GET /metrics``, ``GET /get_tokenizer_files`` (for routers that key on token blocks),
``GET /cache_events``, ``GET /cache_snapshot``, ``POST /prefix_blocks``, ``GET /load`` (the radix cache and the load
for routers, ``cache_state.py``), ``GET /openapi.json`` (``contracts/openapi.py``). ``drain.py`` is the graceful
drain of SIGTERM / Ctrl-C (``run_engine``). Every error is the OpenAI error body
(``radixserve.contracts.protocol.error_body``): validation errors are 400 (not FastAPI's 422), unexpected exceptions
500 without a traceback. A pure-ASGI middleware assigns and echoes ``x-request-id``, enforces the request body limit
(413) and the optional bearer API key (401). The HTTP event loop never runs a model forward: the engine's scheduler
thread does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request

from radixserve.contracts import block_hash, constants, openapi
from radixserve.contracts.edge import BODY_SCOPE_KEY, EdgeMiddleware, error_response, http_exception_handler
from radixserve.contracts.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateReqInput,
    ModelCard,
    ModelList,
)
from radixserve.engine.io_struct import InvalidRequestError
from radixserve.engine.server import cache_state
from radixserve.engine.server.client_io import ClientDisconnected
from radixserve.engine.server.common import check_unicode
from radixserve.engine.server.context import ServerContext
from radixserve.engine.server.drain import Drain, DrainMiddleware
from radixserve.engine.server.engine_client import EngineClient
from radixserve.engine.server.request_errors import validation_error
from radixserve.engine.server.serving_chat import ChatServing
from radixserve.engine.server.serving_completions import CompletionServing
from radixserve.engine.server.serving_native import NativeServing

if TYPE_CHECKING:  # pragma: no cover
    from radixserve.engine.config import EngineArgs

logger = logging.getLogger("radixserve.engine.server")

# Probes and scrapes stay open when --api-key is set (Kubernetes and Prometheus carry no key), and out of the INFO
# access log (the router and the kubelet probe every few seconds).
_OPEN_PATHS = frozenset({constants.ENGINE_HEALTH_PATH, constants.ENGINE_HEALTH_GENERATE_PATH, "/metrics"})
# The router re-reads /v1/models on every probe, the tokenizer files once per model, and polls the cache events and
# the load.
_PROBE_PATHS = _OPEN_PATHS | {
    constants.ENGINE_TOKENIZER_FILES_PATH,
    "/v1/models",
    block_hash.ENGINE_CACHE_EVENTS_PATH,
    block_hash.ENGINE_CACHE_SNAPSHOT_PATH,
    block_hash.ENGINE_LOAD_PATH,
}


def create_app(engine: EngineClient, manage_engine: bool = True) -> FastAPI:
    """The engine's FastAPI app.

    With ``manage_engine`` the app's lifespan starts the engine (``engine.start()`` in a worker thread, so ``/health``
    answers 503 while it warms up) and shuts it down on exit (Ctrl-C, SIGTERM). Pass False when the caller starts
    and stops the engine itself.

    ``app.state.drain`` is the server's ``Drain`` (``drain.py``): once it runs, ``/health``, ``/health_generate``
    and every new generation request answer its 503 with ``x-radixserve-draining: 1``.
    """
    ctx = ServerContext.of(engine)
    drain = Drain()
    servings = cache_state.Servings(
        chat=ChatServing(ctx), completions=CompletionServing(ctx), generate=NativeServing(ctx)
    )

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

    app = FastAPI(
        title="radixserve engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=openapi.OPENAPI_PATH
    )
    openapi.install(app)
    app.state.ctx = ctx
    app.state.drain = drain
    app.add_middleware(DrainMiddleware, drain=drain)  # inside the edge: request ids and the API key come first
    app.add_middleware(
        EdgeMiddleware,
        max_body_bytes=engine.args.max_request_body_bytes,
        api_key=engine.args.api_key,
        open_paths=_OPEN_PATHS,
    )

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error(exc, request.scope.get(BODY_SCOPE_KEY))
        return error_response(message, 400, param)

    @app.exception_handler(InvalidRequestError)
    async def _on_invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(exc.message, exc.status_code, exc.param)

    app.add_exception_handler(StarletteHTTPException, http_exception_handler)

    @app.exception_handler(ClientDisconnected)
    async def _on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def _on_error(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - the middleware
        logger.exception("unhandled error")  # catches first; kept for errors raised outside it
        return error_response("internal server error", 500)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await servings.chat.handle(request, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await servings.completions.handle(request, body)

    @app.post("/generate")
    async def generate(body: GenerateReqInput, request: Request) -> Response:
        # The rid comes back in meta_info.id: a lone surrogate there cannot be written as UTF-8 (regression: a 500).
        rids = body.rid if isinstance(body.rid, list) else [body.rid]
        for i, rid in enumerate(rids):
            if isinstance(rid, str):
                check_unicode(rid, f"rid[{i}]" if isinstance(body.rid, list) else "rid")
        return await servings.generate.handle(request, body)

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
        if drain.draining:
            return drain.refusal()
        if engine.is_healthy():
            return Response(status_code=200)
        return error_response("the engine is not ready", 503)

    @app.get(constants.ENGINE_HEALTH_GENERATE_PATH)
    async def health_generate() -> Response:
        if drain.draining:
            return drain.refusal()
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

    @app.get(block_hash.ENGINE_CACHE_EVENTS_PATH)
    async def cache_events(request: Request) -> JSONResponse:
        return JSONResponse(cache_state.cache_events_body(ctx, request.query_params.get("since")))

    @app.get(block_hash.ENGINE_CACHE_SNAPSHOT_PATH)
    async def cache_snapshot() -> JSONResponse:
        return JSONResponse(cache_state.cache_snapshot_body(ctx))

    @app.post(block_hash.ENGINE_PREFIX_BLOCKS_PATH)
    async def prefix_blocks(body: dict[str, Any]) -> JSONResponse:
        return JSONResponse(await cache_state.prefix_blocks_body(ctx, servings, body))

    @app.get(block_hash.ENGINE_LOAD_PATH)
    async def load() -> JSONResponse:
        return JSONResponse(cache_state.load_body(ctx))

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


def _log_start_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine failed to start", exc_info=task.exception())


def run_engine(args: EngineArgs) -> int:
    """Load the engine for ``args`` (the served model name defaults to the model directory's or GGUF file's name) and
    serve it with uvicorn on ``args.host:args.port`` until Ctrl-C/SIGTERM; returns the exit status. The app's
    lifespan shuts the engine down.

    The first Ctrl-C/SIGTERM drains (``Drain.run``; docs/contracts.md, "Graceful drain"): ``/health`` and new
    generation requests get a 503 with ``x-radixserve-draining: 1`` at once, the requests in flight finish for up
    to ``args.shutdown_timeout`` seconds, the rest are then aborted (a 503, or an SSE error event and ``[DONE]``);
    a second signal aborts them at once. Then uvicorn shuts down and the process exits 0 (SIGTERM included).

    Order: the model paths are checked, then the listening sockets are bound (``bind_listen_sockets``; a port in use
    or a host that does not resolve raises its one-line ``BindError`` within milliseconds, before torch is imported),
    then the model loads, then uvicorn listens on those sockets and the "serving ... on URL" line is logged. Ctrl-C
    is a stop asked for, at any point: exit status 0, and while the model loads one INFO line."""
    import signal
    import threading

    from radixserve.engine.model.locate import check_model_paths

    check_model_paths(args.model_path, args.tokenizer_path)  # one clear line (a ValueError) before torch is imported
    from radixserve.contracts.serving import bind_listen_sockets, serve

    sockets = bind_listen_sockets(args.host, args.port)
    try:
        from radixserve.engine.engine import Engine, default_served_model_name

        if not args.served_model_name:  # regression: a .GGUF in upper case kept its extension in the name
            args.served_model_name = default_served_model_name(args.model_path)
        logger.info("loading %s (served as %s)", args.model_path, args.served_model_name)
        engine = Engine(args)
    except BaseException as e:
        for sock in sockets:
            sock.close()
        if isinstance(e, KeyboardInterrupt):
            logger.info("stopped while loading the model (Ctrl-C)")
            return 0
        raise
    app = create_app(engine)

    def abort_requests_in_flight() -> None:
        # Abort in-flight requests at once (clients get an OpenAI-format 503 or a stream error event) instead of
        # letting uvicorn wait out its graceful timeout and cancel handlers mid-response.
        threading.Thread(target=engine.shutdown, name="radixserve-shutdown", daemon=True).start()

    drain: Drain = app.state.drain

    async def run_drain() -> None:
        await drain.run(args.shutdown_timeout, abort_requests_in_flight)

    def log_serving(url: str) -> None:
        logger.info("serving %s on %s", engine.served_model_name, url)

    # uvicorn re-raises the signal it handled once shut down cleanly: SIGTERM too comes out as KeyboardInterrupt
    # (exit status 0 after a drain, not death by SIGTERM). Set here, after loading: a SIGTERM then stops as before.
    previous_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return serve(
            app,
            args.host,
            args.port,
            args.log_level,
            sockets=sockets,
            on_listening=log_serving,
            drain=run_drain,
            probe_paths=_PROBE_PATHS,
            timeout_graceful_shutdown=5,
        )
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm or signal.SIG_DFL)
