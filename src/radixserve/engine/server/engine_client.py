"""``EngineClient``: everything the HTTP layer asks of an engine, and nothing more.

``engine/engine.py`` ``Engine`` (the real one: model, scheduler thread) and ``tests/fake_engine.py`` ``FakeEngine``
(scripted outputs over the real tokenizer) both implement it; mypy checks both against this protocol (``run_engine``
hands an ``Engine`` to ``create_app``, and the fake declares itself an ``EngineClient``). The server reads no other
attribute of an engine, so a field added here is a field both must provide: no ``getattr`` fallbacks.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from radixserve.engine.config import EngineArgs
    from radixserve.engine.io_struct import GenerateRequest, ReqOutput
    from radixserve.engine.memory.cache_events import CacheEventLog
    from radixserve.engine.metrics import EngineMetrics


class EngineClient(Protocol):
    """The engine as the HTTP server sees it.

    Attributes:
        args: the engine's configuration (the server reads its HTTP and compatibility flags: ``api_key``,
            ``max_request_body_bytes``, ``tool_choice_as_auto``, ``reasoning_parser``, ...).
        tokenizer: the Hugging Face tokenizer (``encode``, ``decode``, ``apply_chat_template``, ...).
        served_model_name: the ``model`` name clients send and responses carry.
        context_length: prompt + output tokens a request may take at most.
        vocab_size: token ids are in ``[0, vocab_size)``.
        sampling_defaults: ``--preferred-sampling-params``, the defaults for fields a request does not set.
        metrics: the Prometheus metrics ``GET /metrics`` renders.
        cache_events: the radix cache's block events for routers; None when they are off.
    """

    args: EngineArgs
    tokenizer: Any
    served_model_name: str
    context_length: int
    vocab_size: int
    sampling_defaults: dict[str, Any]
    metrics: EngineMetrics
    cache_events: CacheEventLog | None

    def start(self) -> None:
        """Warm up and start serving (blocking; the app's lifespan runs it in a worker thread)."""
        ...

    def shutdown(self) -> None:
        """Stop serving; requests in flight finish with an abort. Idempotent."""
        ...

    def is_healthy(self) -> bool:
        """True while the engine serves requests."""
        ...

    async def health_generate(self, timeout_s: float = 20.0) -> bool:
        """Deep health check: recent output, or a one-token generation within ``timeout_s`` seconds."""
        ...

    async def flush_cache(self) -> bool:
        """Drop every cached prefix; False while requests are in flight."""
        ...

    def abort(self, rid: str) -> None:
        """Abort request ``rid`` (all its samples); unknown ids are ignored."""
        ...

    def load_snapshot(self) -> dict[str, int]:
        """``GET /load``'s numbers: queued / running requests and tokens, ``max_total_tokens``."""
        ...

    def model_info(self) -> dict[str, Any]:
        """``GET /get_model_info``'s static facts (JSON-serialisable)."""
        ...

    async def check_grammar(self, kind: str, text: str) -> None:
        """Compile (or find cached) the constraint ``(kind, text)``, ``kind`` one of ``json_schema``, ``regex``,
        ``ebnf``. Raises ``InvalidRequestError`` (400 naming ``kind``) when it is invalid or unsupported."""
        ...

    def generate(self, req: GenerateRequest) -> AsyncGenerator[ReqOutput, None]:
        """Run ``req``: ``ReqOutput`` deltas of its ``n`` samples until each has finished.

        Raises ``InvalidRequestError`` before the first output (503 not serving, 429 queue full, 400 bad grammar or
        duplicate rid). Closing the generator early aborts the request and frees its KV cache.
        """
        ...
