"""The continuous-batching scheduler loop (runs in its own thread; HTTP handlers never run a forward).

Each iteration: take new requests and aborts, then either run one prefill (EXTEND) batch admitted under the token
budgets (``prefill.py``) or one decode step over every running request (``decode.py``, which retracts the newest
requests when the KV pool runs out). The parts, each in its own module, after mini-sglang's scheduler/ folder
(python/minisgl/scheduler/) and SGLang's scheduler (srt/managers/scheduler.py, schedule_policy.py):

- ``prefill.PrefillManager``: the waiting queue, the chunked request, admission;
- ``decode.DecodeManager``: the running set, retraction;
- ``cache.KVCacheManager``: slots, request rows, the prefix cache (``RadixCache`` or ``NoPrefixCache``), one
  ``cache_req(req, finished)``;
- ``batch``: ``ForwardBatch`` building; ``sample_step.BatchSampler``: sampling with grammar masks;
- ``output.OutputProcessor``: tokens -> text, finish checks (``finish.FinishReason``), ``ReqOutput`` deltas;
- ``input_logprobs``: the prompt tokens a prefill batch scores (``logprob_start_len``), across chunks;
- ``timing``: the per-step split (forward / sampling / scheduling / output) and grammar timing.

This module keeps the loop and the thread-safe API (``submit``, ``abort``, ``call``, ``start``, ``stop``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.engine.io_struct import GenerateRequest, ReqOutput
from radixserve.engine.memory.allocator import ReqToTokenPool, TokenSlotAllocator
from radixserve.engine.memory.cache_events import CacheEventLog
from radixserve.engine.memory.no_prefix_cache import NoPrefixCache
from radixserve.engine.memory.radix_cache import RadixCache
from radixserve.engine.scheduler.batch import decode_batch, extend_batch
from radixserve.engine.scheduler.cache import KVCacheManager, PrefixCache
from radixserve.engine.scheduler.config import SchedulerConfig
from radixserve.engine.scheduler.decode import DecodeManager
from radixserve.engine.scheduler.finish import FinishKind, FinishReason
from radixserve.engine.scheduler.input_logprobs import complete_input_logprobs, plan_input_logprobs
from radixserve.engine.scheduler.output import OutputProcessor
from radixserve.engine.scheduler.prefill import DECODE_RESERVE_CLIP, DECODE_RESERVE_RATIO, PrefillManager
from radixserve.engine.scheduler.request import Req
from radixserve.engine.scheduler.sample_step import BatchSampler
from radixserve.engine.scheduler.seeds import sample_generator, sample_seed
from radixserve.engine.scheduler.stats import DecodeSnapshot, DecodeStatsLog, LoadSnapshot
from radixserve.engine.scheduler.timing import GrammarTiming, StepTiming

# Re-exported: other modules and tests import these from here.
__all__ = [
    "DECODE_RESERVE_CLIP",
    "DECODE_RESERVE_RATIO",
    "FinishKind",
    "FinishReason",
    "GrammarTiming",
    "Scheduler",
    "SchedulerConfig",
    "StepTiming",
    "sample_seed",
]

logger = logging.getLogger(__name__)


@dataclass
class _PhaseTimes:
    """Seconds of one step's forward, sampling and output phases (scheduling is the rest of the step)."""

    decode_batch: int | None  # sequences of a decode step; None for a prefill step
    forward_s: float
    sample_s: float
    output_s: float


class Scheduler:
    """Owns the KV memory (allocator, req_to_token, prefix cache) and the model runner; produces ``ReqOutput``s.

    ``emit(outputs)`` is called from the scheduler thread once per step with every delta produced in that step.
    ``cache_events``: where the radix cache publishes its blocks (None: nowhere; ``NoPrefixCache`` publishes nothing).
    Thread-safety: ``submit`` and ``abort`` may be called from any thread, ``load`` (a ``LoadSnapshot`` replaced
    after every step) read from any; everything else runs on the loop thread.
    """

    def __init__(
        self,
        runner: Any,
        tokenizer: Any,
        config: SchedulerConfig,
        eos_token_ids: list[int],
        emit: Callable[[list[ReqOutput]], None],
        metrics: Any = None,
        cache_events: CacheEventLog | None = None,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.emit = emit
        self.metrics = metrics
        self.device = runner.device

        self.allocator = TokenSlotAllocator(runner.max_total_tokens)
        # Rows: every running request plus one being chunk-prefilled plus a parent about to fork.
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests + 2, config.context_length + 1)
        self.req_to_token = self.req_to_token_pool.req_to_token
        self.cache: PrefixCache = (
            NoPrefixCache(self.allocator)
            if config.disable_radix_cache
            else RadixCache(self.allocator, events=cache_events)
        )
        self.kv = KVCacheManager(self.allocator, self.req_to_token_pool, self.cache)
        self.prefill = PrefillManager(config, self.kv, self._on_admit)
        self.decode = DecodeManager()
        self.sampler = BatchSampler(
            lambda: int(runner.model_config.vocab_size), config.max_running_requests, self.eos_token_ids
        )
        self.output = OutputProcessor(self.eos_token_ids, config, metrics)

        self.inbox: queue.Queue[GenerateRequest | None] = queue.Queue()  # None: wake the loop
        self.aborts: collections.deque[str] = collections.deque()
        # (fn, result_queue) run on the loop thread between steps
        self.control: queue.Queue[tuple[Callable[[], Any], queue.Queue[tuple[bool, Any]]]] = queue.Queue()

        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.future: concurrent.futures.Future[None] | None = None
        self.alive = False
        self.last_output_time = 0.0
        self.forward_count = 0
        self.error: BaseException | None = None
        # The prefill batch being run: out of ``waiting`` and not yet ``running`` while its forward runs, so a crash
        # there must still fail these requests (regression: their clients hung).
        self._extending: list[Req] = []
        self.grammar_timing = GrammarTiming({})
        self.step_timing = StepTiming()
        self.decode_stats = DecodeStatsLog(config.decode_log_interval)
        self.load = LoadSnapshot(max_total_tokens=self.allocator.size)

    # ----------------------------------------------------------------------------------------------------------
    # the queues (read by the engine facade, tests and benches)
    @property
    def waiting(self) -> list[Req]:
        """Requests queued for prefill (admission order is the policy's, not this list's)."""
        return self.prefill.waiting

    @property
    def running(self) -> list[Req]:
        """Samples decoding."""
        return self.decode.running

    @property
    def chunked_req(self) -> Req | None:
        """The request whose prompt is being prefilled in chunks, if any."""
        return self.prefill.chunked_req

    def _busy(self) -> bool:
        return self.prefill.runnable or self.decode.runnable

    # ----------------------------------------------------------------------------------------------------------
    # thread-safe API
    def submit(self, greq: GenerateRequest) -> None:
        """Queue a request (any thread)."""
        self.inbox.put(greq)

    def abort(self, rid: str) -> None:
        """Abort every sample of request ``rid`` wherever it is (any thread); it finishes with type "abort"."""
        self.aborts.append(rid)
        self.inbox.put(None)  # wake the loop

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn`` on the loop thread between steps and return its result (any thread)."""
        result: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self.control.put((fn, result))
        self.inbox.put(None)
        ok, value = result.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def start(self, executor: concurrent.futures.Executor | None = None) -> None:
        """Run the loop on ``executor`` (a single-thread executor that already ran the model's start-up), or on a
        new thread. Why an executor: once one thread has run OpenMP-parallel torch ops, torch ops on another
        thread ran ~1.8x slower here (bf16 linear 228 -> 352 us), so load, warm-up and loop share one thread."""
        self.alive = True
        if executor is not None:
            self.future = executor.submit(self._loop)
            return
        self.thread = threading.Thread(target=self._loop, name="radixserve-scheduler", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; every request still in flight finishes with an abort."""
        self._stop.set()
        self.inbox.put(None)
        if self.thread is not None:
            self.thread.join(timeout)
        if self.future is not None:
            concurrent.futures.wait([self.future], timeout)

    # ----------------------------------------------------------------------------------------------------------
    # the loop
    def _loop(self) -> None:
        try:
            # The runner returns inference tensors; sampling updates them in place, so it must run in the same mode.
            with torch.inference_mode():
                while not self._stop.is_set():
                    self._recv(block=not self._busy())
                    self._process_control()
                    self._process_aborts()
                    self.step()
        except BaseException as e:  # a bug in the loop: report, fail every request, mark unhealthy
            logger.exception("scheduler loop crashed")
            self.error = e
        finally:
            self.alive = False
            self._abort_all("engine is shutting down" if self.error is None else f"engine error: {self.error}")

    def step(self) -> None:
        """One scheduling step: a prefill batch if one can be admitted, else a decode step."""
        t0 = time.perf_counter()
        outputs: list[ReqOutput] = []
        batch = self.prefill.schedule(self.decode.running)
        phases = None
        if batch:
            self._extending = batch
            phases = self._run_extend(batch, outputs)
            self._extending = []
        elif self.decode.running:
            phases = self._run_decode(outputs)
        t_emit = time.perf_counter()
        if outputs:
            self.last_output_time = time.monotonic()
            self.emit(outputs)
        emit_s = time.perf_counter() - t_emit
        self._update_gauges()
        if not self._busy():
            self.decode_stats.on_idle()
        if phases is not None:
            output_s = phases.output_s + emit_s
            schedule_s = time.perf_counter() - t0 - phases.forward_s - phases.sample_s - output_s
            self.step_timing.add(phases.decode_batch, phases.forward_s, phases.sample_s, schedule_s, output_s)

    def _recv(self, block: bool) -> None:
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                self._add_request(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _add_request(self, greq: GenerateRequest) -> None:
        try:
            self._add_request_unchecked(greq)
        except Exception as e:  # one bad request must not take the loop (and every other request) down
            logger.exception("rejected request %s", greq.rid)
            self.prefill.waiting[:] = [r for r in self.prefill.waiting if r.rid != greq.rid]
            fr = FinishReason.abort(f"invalid request: {e}", 400).to_dict()
            self.emit(
                [
                    ReqOutput(greq.rid, i, "", [], None, fr, len(greq.input_ids), 0, 0)
                    for i in range(max(greq.sampling_params.n, 1))
                ]
            )

    def _add_request_unchecked(self, greq: GenerateRequest) -> None:
        params = greq.sampling_params
        # Parallel sampling shares one prefill through the prefix cache; without one each sample prefills alone.
        fork = params.n > 1 and self.kv.shares_prefixes
        count = 1 if fork else params.n
        for i in range(count):
            req = Req(greq, i, self.tokenizer, sample_generator(params.seed, i, self.device))
            req.num_samples = params.n if fork else 1
            self.prefill.add(req)
        self.decode_stats.record_prompt(prompt_tokens=len(greq.input_ids) * params.n)
        if self.metrics is not None:
            self.metrics.prompt_tokens_total.inc(len(greq.input_ids) * params.n)

    def _on_admit(self, req: Req, counts_cached: bool, first_schedule: bool) -> None:
        """Stats and metrics of an admitted request (``prefill.AdmitHook``)."""
        if counts_cached:
            self.decode_stats.record_prompt(cached_tokens=req.cached_tokens * req.num_samples)
            if self.metrics is not None:
                self.metrics.cached_tokens_total.inc(req.cached_tokens * req.num_samples)
        if first_schedule and self.metrics is not None and req.first_scheduled_time is not None:
            self.metrics.queue_time_seconds.observe(req.first_scheduled_time - req.arrival_time)

    def _process_control(self) -> None:
        while True:
            try:
                fn, result = self.control.get_nowait()
            except queue.Empty:
                return
            try:
                result.put((True, fn()))
            except Exception as e:  # returned to the caller, the loop goes on
                result.put((False, e))

    def _process_aborts(self) -> None:
        if not self.aborts:
            return
        rids = set()
        while self.aborts:
            rids.add(self.aborts.popleft())
        self._recv(block=False)  # a request submitted just before its abort may still be in the inbox
        outputs: list[ReqOutput] = []
        for req in self.prefill.take(rids) + self.decode.take(rids):
            self._finish(req, FinishReason.abort("aborted"), outputs)
        if outputs:
            self.emit(outputs)

    def _abort_all(self, message: str) -> None:
        outputs: list[ReqOutput] = []
        chunked = [self.prefill.chunked_req] if self.prefill.chunked_req is not None else []
        reqs = list({id(r): r for r in self.prefill.waiting + self.decode.running + chunked + self._extending}.values())
        self.prefill.waiting, self.decode.running, self.prefill.chunked_req, self._extending = [], [], None, []
        reason = FinishReason.abort(message)
        for req in reqs:
            try:
                self._finish(req, reason, outputs)
            except Exception:  # memory state may be broken after a crash; still tell every client
                req.finish_reason = reason
                outputs.append(self.output.make_output(req))
            for i in range(req.index + 1, req.index + req.num_samples):  # an unforked parent's other samples
                outputs.append(ReqOutput(req.rid, i, "", [], None, reason.to_dict(), len(req.origin_input_ids), 0, 0))
        while True:  # requests submitted but never received
            try:
                greq = self.inbox.get_nowait()
            except queue.Empty:
                break
            if greq is not None:
                for i in range(greq.sampling_params.n):
                    outputs.append(ReqOutput(greq.rid, i, "", [], None, reason.to_dict(), len(greq.input_ids), 0, 0))
        if outputs:
            self.emit(outputs)

    # ----------------------------------------------------------------------------------------------------------
    # forward passes
    def _run_extend(self, batch: list[Req], outputs: list[ReqOutput]) -> _PhaseTimes | None:
        for req in list(batch):
            try:
                self.kv.alloc_extend(req)
            except MemoryError:
                # Should not happen thanks to admission control; put the request back rather than fail it.
                batch.remove(req)
                req.extend_len = 0
                self._retract(req)
        if not batch:
            return None
        fb = extend_batch(batch, self.req_to_token, self.device)
        plan = plan_input_logprobs(batch)  # prompt tokens to score in this batch (logprob_start_len)
        t_fwd = time.perf_counter()
        if plan is None:
            logits = self.runner.forward(fb)
        else:
            logits, scores = self.runner.forward_with_input_logprobs(fb, plan.query)
            plan.deliver(scores)
        forward_s = time.perf_counter() - t_fwd
        self.forward_count += 1

        done: list[tuple[int, Req]] = []
        for i, req in enumerate(batch):
            req.kv_len += req.extend_len
            req.extend_len = 0
            complete_input_logprobs(req)
            # A chunk or a whole prompt: into the cache right away, so siblings and later requests hit it.
            self.kv.cache_req(req, finished=False)
            if req.kv_len == req.seq_len:
                done.append((i, req))
        rows: list[int] = []
        samplers: list[Req] = []
        for i, req in done:
            children = self._fork(req) if req.num_samples > 1 else [req]
            if req.params.max_new_tokens == 0:  # prefill only (e.g. scoring the prompt): every sample ends here
                for child in children:
                    self._finish(child, FinishReason.length(), outputs)
                continue
            for child in children:
                rows.append(i)
                samplers.append(child)
        sample_s = output_s = 0.0
        if samplers:
            t_smp = time.perf_counter()
            sampled = self.sampler.sample(logits[rows], samplers)
            t_out = time.perf_counter()
            finished = self.output.process(samplers, sampled, outputs)
            sample_s, output_s = t_out - t_smp, time.perf_counter() - t_out
            for req in finished:
                self.kv.cache_req(req, finished=True)
        for req in samplers:
            if not req.finished:
                self.decode.add(req)
        return _PhaseTimes(None, forward_s, sample_s, output_s)

    def _run_decode(self, outputs: list[ReqOutput]) -> _PhaseTimes | None:
        # Every running request needs one slot; retract the newest until that fits.
        self.decode.retract_until_fits(self.kv, self._retract)
        if not self.decode.running:
            return None
        t_step = time.perf_counter()
        batch = list(self.decode.running)
        fb = decode_batch(batch, self.req_to_token, self.kv.alloc_slots(len(batch)), self.device)
        t_fwd = time.perf_counter()
        logits = self.runner.forward(fb)
        t_smp = time.perf_counter()
        self.forward_count += 1
        for req in batch:
            req.kv_len = req.seq_len
        sampled = self.sampler.sample(logits, batch)
        t_out = time.perf_counter()
        finished = self.output.process(batch, sampled, outputs)
        t_done = time.perf_counter()
        for req in finished:
            self.kv.cache_req(req, finished=True)
        self.decode.drop_finished()
        constrained = sum(1 for r in batch if r.grammar is not None)
        self.grammar_timing.add(len(batch), constrained, time.perf_counter() - t_step, self.sampler.grammar_s)
        self.decode_stats.on_decode_step(len(batch), t_step, self._decode_snapshot)
        return _PhaseTimes(len(batch), t_smp - t_fwd, t_out - t_smp, t_done - t_out)

    # ----------------------------------------------------------------------------------------------------------
    # finishing, forking, retraction
    def _finish(self, req: Req, reason: FinishReason, outputs: list[ReqOutput]) -> None:
        """Finish ``req`` (last delta into ``outputs``) and give its KV back to the cache / allocator."""
        self.output.finish(req, reason, outputs)
        self.kv.cache_req(req, finished=True)

    def _fork(self, parent: Req) -> list[Req]:
        """Split a prefilled parent into ``n`` samples sharing its prompt KV (all of it is in the radix tree now)."""
        children = [parent]
        for i in range(1, parent.num_samples):
            child = Req(parent.greq, i, self.tokenizer, sample_generator(parent.params.seed, i, self.device))
            self.kv.fork(parent, child)
            child.cached_tokens = parent.cached_tokens
            child.cached_tokens_set = True
            child.first_scheduled_time = parent.first_scheduled_time
            child.input_logprobs = parent.input_logprobs  # the prompt's, scored once by the parent's prefill
            child.num_samples = 1
            children.append(child)
        parent.num_samples = 1
        return children

    def _retract(self, req: Req) -> None:
        """Preempt ``req``: release its KV (cached for reuse) and put it back at the head of the queue."""
        self.kv.cache_req(req, finished=True)
        self.prefill.requeue(req)
        if self.metrics is not None:
            self.metrics.num_retracted_reqs_total.inc()
        logger.info("retracted %s: KV pool exhausted", req)

    # ----------------------------------------------------------------------------------------------------------
    # introspection / control (loop thread)
    def flush_cache(self) -> bool:
        """Drop every cached prefix. False (nothing done) while requests are in flight."""
        if self._busy():
            return False
        self.kv.flush()
        return True

    def used_tokens(self) -> int:
        """KV slots not free (held by requests or the radix tree), tokens."""
        return self.kv.used_tokens()

    def _decode_snapshot(self) -> DecodeSnapshot:
        """The stats line's view of the engine (as the gauges: a chunked prefill counts as running)."""
        return DecodeSnapshot(
            running_reqs=len(self.decode.running) + (1 if self.prefill.chunked_req is not None else 0),
            queued_reqs=len(self.prefill.waiting),
            used_tokens=self.used_tokens() - self.cache.evictable_size(),
            max_total_tokens=self.allocator.size,
        )

    def _update_load(self) -> None:
        """Publish this step's ``LoadSnapshot`` (O(waiting requests))."""
        chunked = self.prefill.chunked_req
        waiting = self.prefill.waiting
        queued_tokens = sum(r.seq_len - r.kv_len for r in waiting)
        if chunked is not None:
            queued_tokens += chunked.seq_len - chunked.kv_len
        self.load = LoadSnapshot(
            queued_requests=len(waiting),
            queued_prefill_tokens=queued_tokens,
            running_requests=len(self.decode.running) + (1 if chunked is not None else 0),
            running_tokens=self.used_tokens() - self.cache.evictable_size(),
            max_total_tokens=self.allocator.size,
        )

    def _update_gauges(self) -> None:
        self._update_load()
        m = self.metrics
        if m is None:
            return
        used = self.used_tokens()
        evictable = self.cache.evictable_size()
        m.num_running_reqs.set(len(self.decode.running) + (1 if self.prefill.chunked_req is not None else 0))
        m.num_queue_reqs.set(len(self.prefill.waiting))
        m.num_used_tokens.set(used)
        m.num_evictable_tokens.set(evictable)
        m.max_total_num_tokens.set(self.allocator.size)
        m.token_usage.set((used - evictable) / max(self.allocator.size, 1))
