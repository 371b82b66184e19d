"""The bodies of the engine's cache-state routes for routers: ``GET /cache_events``, ``GET /cache_snapshot``,
``POST /prefix_blocks`` and ``GET /load`` (docs/contracts.md, "Cache events and load (engine → router)").

Block hashes are ``contracts/block_hash.py``'s, in the namespace ``("tokens", served model name, None)``, as JSON
integers (unsigned 64-bit). The events come from ``engine/memory/cache_events.py`` ``CacheEventLog`` (None when
``--cache-event-block-tokens 0`` or ``--disable-radix-cache``: the event routes answer 404). ``POST /prefix_blocks``
renders and tokenizes a request's prompt with the server's own code (the endpoint's ``Serving``), so a
router can check that its ``PrefixKey`` names the same blocks. Errors are ``InvalidRequestError`` (the contracts'
error body), never a 500.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from radixserve.contracts.block_hash import chain_block_hashes, namespace_digest
from radixserve.contracts.protocol import ChatCompletionRequest, CompletionRequest, GenerateReqInput
from radixserve.engine.io_struct import InvalidRequestError
from radixserve.engine.server.context import ServerContext
from radixserve.engine.server.request_errors import validation_error
from radixserve.engine.server.serving_chat import ChatServing
from radixserve.engine.server.serving_completions import CompletionServing
from radixserve.engine.server.serving_native import NativeServing

if TYPE_CHECKING:  # pragma: no cover
    from radixserve.engine.memory.cache_events import CacheEvent, CacheEventLog

PREFIX_BLOCK_ENDPOINTS = ("chat", "completions", "generate")
_REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
    "generate": GenerateReqInput,
}


@dataclass(frozen=True)
class Servings:
    """The app's generating endpoints, by ``POST /prefix_blocks`` endpoint name."""

    chat: ChatServing
    completions: CompletionServing
    generate: NativeServing

    def named(self, endpoint: str) -> ChatServing | CompletionServing | NativeServing:
        """The serving of ``endpoint`` (one of ``PREFIX_BLOCK_ENDPOINTS``)."""
        servings: dict[str, ChatServing | CompletionServing | NativeServing] = {
            "chat": self.chat,
            "completions": self.completions,
            "generate": self.generate,
        }
        return servings[endpoint]


def _event_log(ctx: ServerContext) -> CacheEventLog:
    log = ctx.engine.cache_events
    if log is None:
        raise InvalidRequestError(
            "this engine publishes no cache events (--cache-event-block-tokens 0 or --disable-radix-cache)",
            status_code=404,
        )
    return log


def _event_json(ev: CacheEvent) -> dict[str, Any]:
    return {"seq": ev.seq, "type": ev.type, "blocks": list(ev.hashes)}


def cache_events_body(ctx: ServerContext, since: str | None) -> dict[str, Any]:
    """``GET /cache_events?since=SEQ``: ``{"incarnation", "model", "block_tokens", "seq" (the latest), "gap",
    "events": [{"seq", "type": "stored" | "removed" | "cleared", "blocks": [int]}]}``, the events after SEQ (default
    0), oldest first. ``gap`` true (and no events): some are gone from the ring, or SEQ is newer than the latest
    (another incarnation's): take ``/cache_snapshot`` again. Raises InvalidRequestError: 404 without events, 400 for
    a SEQ that is not an integer >= 0."""
    log = _event_log(ctx)
    seq = 0
    if since is not None:
        s = since.strip()
        if not s.isascii() or not s.isdigit():
            raise InvalidRequestError(f"since must be an integer >= 0, got {since!r}", "since")
        seq = int(s)
    got = log.since(seq)
    return {
        "incarnation": got.incarnation,
        "model": log.model,
        "block_tokens": log.block_tokens,
        "seq": got.seq,
        "gap": got.gap,
        "events": [_event_json(ev) for ev in got.events],
    }


def cache_snapshot_body(ctx: ServerContext) -> dict[str, Any]:
    """``GET /cache_snapshot``: ``{"incarnation", "model", "block_tokens", "seq", "blocks": [int]}``, every block
    held at ``seq`` (sorted); follow on with ``/cache_events?since=seq``. Raises InvalidRequestError 404 without
    events."""
    log = _event_log(ctx)
    snap = log.snapshot()
    return {
        "incarnation": snap.incarnation,
        "model": log.model,
        "block_tokens": log.block_tokens,
        "seq": snap.seq,
        "blocks": list(snap.blocks),
    }


def load_body(ctx: ServerContext) -> dict[str, Any]:
    """``GET /load``: ``{"incarnation" (null without events), "queued_requests", "queued_prefill_tokens",
    "running_requests", "running_tokens", "max_total_tokens"}`` (requests count samples, tokens are KV tokens; see
    ``scheduler/stats.py`` ``LoadSnapshot``). O(1), from the scheduler's latest step."""
    log = ctx.engine.cache_events
    return {"incarnation": log.incarnation if log is not None else None, **ctx.engine.load_snapshot()}


def _parse_request(endpoint: str, raw: dict[str, Any]) -> Any:
    try:
        return _REQUEST_MODELS[endpoint].model_validate(raw)
    except ValidationError as e:
        message, param = validation_error(RequestValidationError(e.errors()), None)
        raise InvalidRequestError(message, f"request.{param}" if param else "request") from None


def _first_prompt_ids(servings: Servings, endpoint: str, req: Any) -> list[int]:
    """The token ids the engine would prefill for ``req`` (its first prompt for a batch). Runs in a worker thread."""
    return servings.named(endpoint).prompt_token_ids(req)[0]


async def prefix_blocks_body(ctx: ServerContext, servings: Servings, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /prefix_blocks`` ``{"endpoint": "chat" | "completions" | "generate", "request": {...}}``: ``{"model",
    "block_tokens", "prompt_tokens", "blocks": [int]}``, the full-block hashes of the prompt that request would
    prefill, rendered and tokenized as its endpoint does (chat template, tools, special tokens; a batch: its first
    prompt). ``cache_salt`` is ignored, as the engine's cache ignores it. Raises InvalidRequestError: 404 with
    ``--cache-event-block-tokens 0`` or for another model (as the endpoint itself), 400 for a bad body, with
    ``param`` prefixed ``request.`` for a field of the inner request."""
    block_tokens = int(ctx.engine.args.cache_event_block_tokens)
    if block_tokens <= 0:
        raise InvalidRequestError("this engine hashes no blocks (--cache-event-block-tokens 0)", status_code=404)
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in PREFIX_BLOCK_ENDPOINTS:
        raise InvalidRequestError(
            f"endpoint must be one of {', '.join(PREFIX_BLOCK_ENDPOINTS)}, got {endpoint!r}", "endpoint"
        )
    raw = body.get("request")
    if not isinstance(raw, dict):
        raise InvalidRequestError("request must be a JSON object: a request body of that endpoint", "request")
    req = _parse_request(endpoint, raw)
    try:
        if endpoint != "generate":
            ctx.check_model(req.model)
        ids = await asyncio.to_thread(_first_prompt_ids, servings, endpoint, req)
    except InvalidRequestError as e:
        raise InvalidRequestError(e.message, f"request.{e.param}" if e.param else "request", e.status_code) from None
    h0 = namespace_digest("tokens", ctx.model_name, None)
    assert h0 is not None  # a str model name always encodes
    return {
        "model": ctx.model_name,
        "block_tokens": block_tokens,
        "prompt_tokens": len(ids),
        "blocks": chain_block_hashes(h0, ids, block_tokens),
    }
