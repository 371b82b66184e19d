"""A minimal engine stand-in that answers at once with canned responses, for measuring the router's own cost.

It speaks just enough of the engine's HTTP surface for the router: ``GET /health``, ``GET /v1/models``,
``GET /get_tokenizer_files`` (404 unless ``--tokenizer-dir`` is given, so the router keys on character blocks or on
real token blocks), ``POST /v1/completions`` and ``/v1/chat/completions`` (non-streaming: one JSON body; streaming:
``--chunks`` SSE chunks ``--chunk-interval-ms`` apart, then ``[DONE]``), ``POST /generate``.
Usage: ``python bench/canned_upstream.py --port 31000 [--tokenizer-dir models/smollm2-135m-instruct]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

MODEL = "canned"


def create_app(chunks: int = 16, chunk_interval_s: float = 0.01, tokenizer_dir: str | None = None):
    """The canned upstream's Starlette app (no validation, no model)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    files: dict[str, str] = {}
    if tokenizer_dir:
        for name in os.listdir(tokenizer_dir):
            if name.startswith("tokenizer") or name.endswith((".jinja", "special_tokens_map.json")):
                with open(os.path.join(tokenizer_dir, name), encoding="utf-8") as f:
                    files[name] = f.read()

    usage = {
        "prompt_tokens": 8,
        "completion_tokens": chunks,
        "total_tokens": 8 + chunks,
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "radixserve"}]})

    async def tokenizer_files(request: Request) -> Response:
        if not files:
            return JSONResponse(
                {"error": {"message": "no tokenizer", "type": "not_found_error", "param": None, "code": 404}},
                status_code=404,
            )
        return JSONResponse({"model": MODEL, "files": files})

    async def completion(request: Request) -> Response:
        body = await request.json()
        chat = request.url.path.endswith("chat/completions")
        rid = request.headers.get("x-request-id", "cmpl-canned")
        headers = {"x-request-id": rid}
        if not body.get("stream"):
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                if chat
                else {"index": 0, "text": "ok", "finish_reason": "stop"}
            )
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion" if chat else "text_completion",
                    "model": MODEL,
                    "choices": [choice],
                    "usage": usage,
                },
                headers=headers,
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            for _ in range(chunks):
                delta = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
                yield f"data: {json.dumps({'id': rid, 'model': MODEL, 'choices': [delta]})}\n\n"
                if chunk_interval_s:
                    await asyncio.sleep(chunk_interval_s)
            if include_usage:
                yield f"data: {json.dumps({'id': rid, 'model': MODEL, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    async def generate(request: Request) -> Response:
        await request.json()
        return JSONResponse(
            {
                "text": "ok",
                "output_ids": [1],
                "meta_info": {
                    "id": "canned",
                    "prompt_tokens": 8,
                    "completion_tokens": 1,
                    "cached_tokens": 0,
                    "finish_reason": {"type": "stop", "matched": None},
                },
            }
        )

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/get_tokenizer_files", tokenizer_files),
            Route("/v1/completions", completion, methods=["POST"]),
            Route("/v1/chat/completions", completion, methods=["POST"]),
            Route("/generate", generate, methods=["POST"]),
        ]
    )


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--chunk-interval-ms", type=float, default=10.0)
    p.add_argument("--tokenizer-dir", default=None)
    a = p.parse_args()
    app = create_app(a.chunks, a.chunk_interval_ms / 1000, a.tokenizer_dir)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning", backlog=4096)


if __name__ == "__main__":
    main()
