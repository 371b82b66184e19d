"""The engine facade the HTTP server talks to: tokenizer + model runner + scheduler thread + metrics.

The scheduler runs in its own thread; ``generate`` bridges its per-step ``ReqOutput`` deltas into the asyncio event
loop of the server, so HTTP handlers never run a forward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from radixserve.engine.config import EngineArgs, torch_compile_choice
from radixserve.engine.context_length import served_context, warn_if_too_short_for_chat
from radixserve.engine.grammar.xgrammar_backend import GrammarBackend
from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, ReqOutput, SamplingParams
from radixserve.engine.memory.cache_events import CacheEventLog
from radixserve.engine.metrics import EngineMetrics
from radixserve.engine.progress import quiet_library_progress_bars
from radixserve.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from radixserve.engine.tokenizer.chat_template import apply_chat_template_flag

logger = logging.getLogger(__name__)

# /health_generate succeeds without a new generation if the scheduler produced output this recently (seconds).
RECENT_OUTPUT_S = 5.0


# Sampling fields a deployment may default (--preferred-sampling-params); the rest are per-request only.
DEFAULTABLE_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def parse_sampling_defaults(text: str | None) -> dict[str, Any]:
    """Parse ``--preferred-sampling-params`` (a JSON object). Raises ValueError for bad JSON or fields."""
    if not text:
        return {}
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--preferred-sampling-params is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ValueError("--preferred-sampling-params must be a JSON object")
    unknown = sorted(set(d) - set(DEFAULTABLE_SAMPLING_FIELDS))
    if unknown:
        raise ValueError(
            f"--preferred-sampling-params: unsupported fields {unknown}; allowed: {list(DEFAULTABLE_SAMPLING_FIELDS)}"
        )
    SamplingParams(**d).validate(vocab_size=1 << 30)
    return d


def load_tokenizer(path: str) -> Any:
    """Load a Hugging Face tokenizer from a model directory or a ``.gguf`` file (no hub access)."""
    from transformers import AutoTokenizer

    from radixserve.engine.model.gguf_sidecar import load_gguf_tokenizer
    from radixserve.engine.model.locate import is_gguf_path

    if is_gguf_path(path):  # from the file's sidecar directory: transformers parses the GGUF once, in a child
        return load_gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def default_served_model_name(model_path: str) -> str:
    """The model directory's (or GGUF file's) name, lower-cased: ``models/SmolLM2-135M`` -> ``smollm2-135m``."""
    from radixserve.engine.model.locate import is_gguf_path

    base = os.path.basename(os.path.normpath(model_path))
    return (base[: -len(".gguf")] if is_gguf_path(base) else base).lower()


def _put_all(items: list[tuple[asyncio.Queue[ReqOutput], ReqOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


class Engine:
    """One engine: loads the model and tokenizer, runs the scheduler thread, streams results to asyncio callers.

    Raises FileNotFoundError / ValueError from ``__init__`` when the model cannot be loaded.
    """

    def __init__(self, args: EngineArgs):
        from radixserve.engine.model.runner import ModelRunner

        self.args = args
        self.sampling_defaults = parse_sampling_defaults(args.preferred_sampling_params)
        self.served_model_name = args.served_model_name or default_served_model_name(args.model_path)
        t0 = time.monotonic()
        quiet_library_progress_bars()  # none in a log file or pipe (a pod's log); the loader's own bar follows suit
        self.tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
        apply_chat_template_flag(self.tokenizer, args.chat_template)
        # Every torch op of this engine (load, warm-up, scheduler loop) runs on this one thread; see Scheduler.start.
        self._torch_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixserve-engine")
        self.runner = self._torch_thread.submit(
            ModelRunner,
            args.model_path,
            dtype=args.dtype,
            device=args.device,
            attention_backend=args.attention_backend,
            max_total_tokens=args.max_total_tokens,
            mem_fraction_static=args.mem_fraction_static,
            context_length=args.context_length,
            num_threads=args.num_threads,
            cpu_omp_threads_bind=args.cpu_omp_threads_bind,
            deterministic=args.enable_deterministic_inference,
            torch_compile=torch_compile_choice(args),
            torch_compile_max_bs=args.torch_compile_max_bs,
            torch_compile_cache_dir=args.torch_compile_cache_dir,
            weight_prepack=False if args.disable_weight_prepack else None,
            quantization=args.quantization,
            torchao_config=args.torchao_config,
        ).result()
        cfg = self.runner.model_config
        context = served_context(
            args.context_length, cfg.max_position_embeddings, self.runner.max_total_tokens, self.runner.kv_pool_rule
        )
        self.context_length = context.tokens
        warn_if_too_short_for_chat(self.context_length, self.tokenizer)
        self.vocab_size = cfg.vocab_size
        if len(self.tokenizer) > cfg.vocab_size:  # its last ids would index past the embedding: a scheduler crash
            self._torch_thread.shutdown(wait=False)
            raise ValueError(
                f"the tokenizer of {args.tokenizer_path or args.model_path} has {len(self.tokenizer):,} tokens, "
                f"more than the model's vocabulary of {cfg.vocab_size:,}: give the model's own tokenizer "
                "(--tokenizer-path)"
            )
        eos = set(getattr(cfg, "eos_token_ids", None) or [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.metrics = EngineMetrics(self.served_model_name)
        # Constrained decoding: grammars compile on the backend's own thread; requests wait for theirs in
        # ``generate`` (the grammar queue) and reach the scheduler only once compiled.
        self.grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids, metrics=self.metrics)
        self._grammar_queue = 0  # requests waiting for their grammar (event-loop threads; approximate)
        # The radix cache's block events for routers (GET /cache_events); a new incarnation id at every start.
        self.cache_events = (
            CacheEventLog(self.served_model_name, args.cache_event_block_tokens)
            if args.cache_event_block_tokens > 0 and not args.disable_radix_cache
            else None
        )
        self.scheduler = self._torch_thread.submit(
            Scheduler,
            self.runner,
            self.tokenizer,
            SchedulerConfig(
                max_running_requests=args.max_running_requests,
                max_prefill_tokens=args.max_prefill_tokens,
                chunked_prefill_size=args.chunked_prefill_size,
                schedule_policy=args.schedule_policy,
                disable_radix_cache=args.disable_radix_cache,
                context_length=self.context_length,
                stream_interval=args.stream_interval,
                decode_log_interval=args.decode_log_interval,
            ),
            self.eos_token_ids,
            self._emit,
            self.metrics,
            cache_events=self.cache_events,
        ).result()
        # rid -> (the caller's event loop, its queue of ReqOutput); callers may live on different loops (tests).
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[ReqOutput]]] = {}
        self._started = False
        self._shutting_down = False
        self._lifecycle = threading.Lock()  # start and shutdown: a stop during warm-up must not start the loop
        logger.info(
            "engine loaded %s in %.1f s (dtype %s, KV pool %s tokens, context %s tokens from %s)",
            args.model_path,
            time.monotonic() - t0,
            str(self.runner.dtype).removeprefix("torch."),
            f"{self.runner.max_total_tokens:,}",
            f"{self.context_length:,}",
            context.source,
        )

    # ----------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Warm up (one forward) and start the scheduler thread; ``is_healthy`` is True afterwards.

        A ``shutdown`` before or during the warm-up wins: the loop is not started and one INFO line says so
        (regression: Ctrl-C or SIGTERM during the warm-up logged "engine failed to start" with a "cannot schedule
        new futures after shutdown" traceback, the loop being submitted to the executor ``shutdown`` had closed)."""
        with self._lifecycle:
            if self._shutting_down:
                logger.info("engine stopped before its warm-up; it served no request")
                return
            warmup = self._torch_thread.submit(self.runner.warmup) if self.args.warmup else None
        if warmup is not None:
            warmup.result()  # outside the lock: a stop must not wait for the forward
        with self._lifecycle:
            if self._stop_asked():  # a method, not the attribute: shutdown may have set it meanwhile
                logger.info("engine stopped during its warm-up; it served no request")
                return
            self.scheduler.start(self._torch_thread)
            self._started = True

    def shutdown(self) -> None:
        """Stop the scheduler; every request in flight finishes with an abort. Safe to call more than once, and
        before or during ``start``."""
        with self._lifecycle:
            self._shutting_down = True
        self.scheduler.stop()
        self._torch_thread.shutdown(wait=False)
        self.grammar_backend.shutdown()

    def _stop_asked(self) -> bool:
        return self._shutting_down

    def is_healthy(self) -> bool:
        return self._started and not self._shutting_down and self.scheduler.alive

    def num_queued(self) -> int:
        """Requests submitted but not yet running (any thread; approximate)."""
        return len(self.scheduler.waiting) + self.scheduler.inbox.qsize() + self._grammar_queue

    def load_snapshot(self) -> dict[str, int]:
        """The engine's load for routers (``GET /load``), any thread, O(1): the scheduler's latest ``LoadSnapshot``
        (``scheduler/stats.py``; tokens are KV tokens) with ``queued_requests`` also counting requests submitted but
        not yet taken in by the loop and those waiting for their grammar."""
        snap = self.scheduler.load
        return {
            "queued_requests": snap.queued_requests + self.scheduler.inbox.qsize() + self._grammar_queue,
            "queued_prefill_tokens": snap.queued_prefill_tokens,
            "running_requests": snap.running_requests,
            "running_tokens": snap.running_tokens,
            "max_total_tokens": snap.max_total_tokens,
        }

    # ----------------------------------------------------------------------------------------------------------
    def _emit(self, outputs: list[ReqOutput]) -> None:
        """Scheduler thread -> the event loop of each output's caller, once per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[ReqOutput], ReqOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.rid)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that caller's loop has closed; nobody is listening
                pass

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[ReqOutput, None]:
        """Run ``req``; yield ``ReqOutput`` deltas of all ``n`` samples until each has finished.

        Raises InvalidRequestError: 503 when not serving, 429 when the queue is full, 400 for a duplicate rid or a
        ``logprob_start_len`` outside the prompt, 400 naming the problem for an invalid or unsupported
        ``json_schema`` / ``regex`` / ``ebnf`` (param = that field).
        Every error is raised before the first output and before the request reaches the scheduler. A constrained
        request first waits here for its grammar to compile (the grammar queue; it holds no KV slot meanwhile).
        Closing the iterator early (client disconnect, cancellation) aborts the request and frees its KV.
        """
        if not self.is_healthy():
            raise InvalidRequestError("engine is not ready or is shutting down", status_code=503)
        if self.num_queued() >= self.args.max_queued_requests:
            raise InvalidRequestError(
                f"too many queued requests (max {self.args.max_queued_requests}); retry later", status_code=429
            )
        if req.sampling_params.n > self.args.max_running_requests:
            raise InvalidRequestError(
                f"n={req.sampling_params.n} exceeds max running requests {self.args.max_running_requests}", "n"
            )
        if req.rid in self._streams:
            raise InvalidRequestError(f"request id {req.rid!r} is already in flight", "rid")
        start = req.logprob_start_len
        if start is not None and (
            not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < len(req.input_ids)
        ):
            raise InvalidRequestError(
                f"logprob_start_len must be a prompt position in [0, {len(req.input_ids)}), got {start!r}",
                "logprob_start_len",
            )
        if not req.arrival_time:
            req.arrival_time = time.monotonic()
        q: asyncio.Queue[ReqOutput] = asyncio.Queue()
        self._streams[req.rid] = (asyncio.get_running_loop(), q)
        key = req.sampling_params.grammar_key()
        if key is not None and req.grammar is None:
            try:
                req.grammar = await self._wait_for_grammar(*key)
            except BaseException:
                self._streams.pop(req.rid, None)
                raise
            if not self.is_healthy():
                self._streams.pop(req.rid, None)
                raise InvalidRequestError("engine is not ready or is shutting down", status_code=503)
        if key is not None:
            self.metrics.num_constrained_requests_total.inc()
        remaining = req.sampling_params.n
        self.scheduler.submit(req)
        try:
            while remaining:
                out = await q.get()
                if out.finished:
                    remaining -= 1
                yield out
        finally:
            self._streams.pop(req.rid, None)
            if remaining:
                self.scheduler.abort(req.rid)

    async def _wait_for_grammar(self, kind: str, text: str) -> Any:
        """The compiled grammar for ``(kind, text)``; raises InvalidRequestError (400) when it is invalid."""
        self._grammar_queue += 1
        self.metrics.num_grammar_queue_reqs.set(self._grammar_queue)
        try:
            return await self.grammar_backend.get(kind, text)
        finally:
            self._grammar_queue -= 1
            self.metrics.num_grammar_queue_reqs.set(self._grammar_queue)

    async def check_grammar(self, kind: str, text: str) -> None:
        """Compile (or find cached) the constraint ``(kind, text)`` without running a request; raises
        InvalidRequestError (400 naming ``kind``) when it is invalid or unsupported."""
        await self.grammar_backend.get(kind, text)

    def abort(self, rid: str) -> None:
        """Abort request ``rid`` (all its samples)."""
        self.scheduler.abort(rid)

    async def flush_cache(self) -> bool:
        """Drop every cached prefix; False while requests are in flight."""
        return await asyncio.to_thread(self.scheduler.call, self.scheduler.flush_cache)

    async def health_generate(self, timeout_s: float = 20.0) -> bool:
        """Deep health check: recent scheduler output, or a one-token generation within ``timeout_s`` seconds."""
        if not self.is_healthy():
            return False
        if time.monotonic() - self.scheduler.last_output_time < RECENT_OUTPUT_S:
            return True
        ids = self.tokenizer.encode("Hi", add_special_tokens=False) or [0]
        req = GenerateRequest(f"health-{uuid.uuid4().hex}", ids, SamplingParams(max_new_tokens=1, temperature=0.0))

        async def run() -> bool:
            async for out in self.generate(req):
                if out.finish_reason is not None:  # out.finished
                    kind: str = out.finish_reason["type"]
                    return kind != "abort"
            return False

        try:
            return await asyncio.wait_for(run(), timeout_s)
        except (TimeoutError, InvalidRequestError):
            return False

    def model_info(self) -> dict[str, Any]:
        """Static facts about the loaded model and the KV pool."""
        cfg = self.runner.model_config
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
            "served_model_name": self.served_model_name,
            "architecture": getattr(cfg, "architecture", None),
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "device": str(self.runner.device),
            "max_total_tokens": self.runner.max_total_tokens,
            "quantization": self.runner.quantization,  # None, "gguf" or a --torchao-config
            "weight_bytes": self.runner.weight_bytes(),
            "kv_pool_bytes": self.runner.kv_pool.total_bytes(),
            "max_running_requests": self.args.max_running_requests,
            "schedule_policy": self.args.schedule_policy,
            "disable_radix_cache": self.args.disable_radix_cache,
            "eos_token_ids": self.eos_token_ids,
        }
