"""The continuous-batching scheduler loop (runs in its own thread; HTTP handlers never run a forward).

Each iteration: take new requests and aborts, then either run one prefill (EXTEND) batch admitted under the token
budgets — prefix hits from the radix cache are skipped, long prompts are prefilled in chunks — or one decode step
over every running request. When the KV pool runs out during decode the newest requests are retracted to the
queue. Design after SGLang's scheduler (srt/managers/scheduler.py, schedule_policy.py) and nano-vllm's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
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
from radixserve.engine.memory.radix_cache import RadixCache
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.sampling.sampler import apply_token_bitmask, sample
from radixserve.engine.scheduler.policy import order_waiting
from radixserve.engine.scheduler.request import Req
from radixserve.engine.scheduler.stats import DecodeSnapshot, DecodeStatsLog

logger = logging.getLogger(__name__)

# Fraction of a running request's remaining max_new_tokens reserved in the pool when admitting new prefills; the rest
# is covered by eviction and, if that is not enough, retraction (SGLang's new_token_ratio idea, fixed here).
DECODE_RESERVE_RATIO = 0.3
# A single request never reserves more than this many decode tokens at admission.
DECODE_RESERVE_CLIP = 256


def sample_seed(seed: int, index: int) -> int:
    """The torch seed of sample ``index`` of a request seeded with ``seed``: the first 8 bytes of
    ``blake2b(f"{seed}:{index}")``, as an unsigned 64-bit integer.

    A hash, not ``seed + index``: with the sum, sample ``i`` of seed ``s + 1`` repeated sample ``i + 1`` of seed ``s``.
    Deterministic across runs and processes (no ``hash()``, which is salted per process), so the same seed and ``n``
    give the same samples. Raises TypeError for a seed that is not an int (validation should have caught it; the
    scheduler then fails that request alone).
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class GrammarTiming:
    """Time spent on grammar work (mask fill + apply + accept) vs whole decode steps, per decode batch shape.

    ``by_shape[(batch_size, constrained_rows)] = [steps, step_seconds, grammar_seconds]``; seconds of wall time on
    the scheduler thread. Read by bench/constrained.py; cheap enough to be always on (two perf_counter calls/step).
    """

    by_shape: dict[tuple[int, int], list[float]]

    def add(self, batch: int, constrained: int, step_s: float, grammar_s: float) -> None:
        rec = self.by_shape.setdefault((batch, constrained), [0, 0.0, 0.0])
        rec[0] += 1
        rec[1] += step_s
        rec[2] += grammar_s


@dataclass
class SchedulerConfig:
    """Scheduler budgets, in tokens / requests."""

    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    chunked_prefill_size: int = 1024
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    context_length: int = 8192
    stream_interval: int = 1
    decode_log_interval: int = 40  # decode steps between "Decode batch." lines (scheduler/stats.py)


class Scheduler:
    """Owns the KV memory (allocator, req_to_token, radix cache) and the model runner; produces ``ReqOutput``s.

    ``emit(outputs)`` is called from the scheduler thread once per step with every delta produced in that step.
    Thread-safety: ``submit`` and ``abort`` may be called from any thread; everything else runs on the loop thread.
    """

    def __init__(
        self,
        runner: Any,
        tokenizer: Any,
        config: SchedulerConfig,
        eos_token_ids: list[int],
        emit: Callable[[list[ReqOutput]], None],
        metrics: Any = None,
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
        self.cache = RadixCache(self.allocator, disable=config.disable_radix_cache)

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
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
        self.grammar_timing = GrammarTiming({})
        self.decode_stats = DecodeStatsLog(config.decode_log_interval)
        self._step_grammar_s = 0.0  # grammar seconds of the current step
        self._token_bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, CPU, reused

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
                    self._recv(block=not (self.waiting or self.running or self.chunked_req))
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
        outputs: list[ReqOutput] = []
        batch = self._get_prefill_batch()
        if batch:
            self._run_extend(batch, outputs)
        elif self.running:
            self._run_decode(outputs)
        if outputs:
            self.last_output_time = time.monotonic()
            self.emit(outputs)
        self._update_gauges()
        if not (self.running or self.waiting or self.chunked_req):
            self.decode_stats.on_idle()

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
            self.waiting = [r for r in self.waiting if r.rid != greq.rid]
            fr = {"type": "abort", "matched": None, "message": f"invalid request: {e}", "status_code": 400}
            self.emit(
                [
                    ReqOutput(greq.rid, i, "", [], None, fr, len(greq.input_ids), 0, 0)
                    for i in range(max(greq.sampling_params.n, 1))
                ]
            )

    def _add_request_unchecked(self, greq: GenerateRequest) -> None:
        params = greq.sampling_params
        # Parallel sampling shares one prefill through the radix tree; without the tree each sample prefills alone.
        fork = params.n > 1 and not self.cache.disable
        count = 1 if fork else params.n
        for i in range(count):
            req = Req(greq, i, self.tokenizer, self._generator(params.seed, i))
            req.num_samples = params.n if fork else 1
            self.waiting.append(req)
        self.decode_stats.record_prompt(prompt_tokens=len(greq.input_ids) * params.n)
        if self.metrics is not None:
            self.metrics.prompt_tokens_total.inc(len(greq.input_ids) * params.n)

    def _generator(self, seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(sample_seed(seed, index))

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
        for req in [r for r in self.waiting if r.rid in rids]:
            self.waiting.remove(req)
            self._finish(req, {"type": "abort", "matched": None, "message": "aborted"}, outputs)
        if self.chunked_req is not None and self.chunked_req.rid in rids:
            req, self.chunked_req = self.chunked_req, None
            self._finish(req, {"type": "abort", "matched": None, "message": "aborted"}, outputs)
        for req in [r for r in self.running if r.rid in rids]:
            self.running.remove(req)
            self._finish(req, {"type": "abort", "matched": None, "message": "aborted"}, outputs)
        if outputs:
            self.emit(outputs)

    def _abort_all(self, message: str) -> None:
        outputs: list[ReqOutput] = []
        reqs = self.waiting + self.running + ([self.chunked_req] if self.chunked_req else [])
        self.waiting, self.running, self.chunked_req = [], [], None
        for req in reqs:
            try:
                self._finish(req, {"type": "abort", "matched": None, "message": message}, outputs)
            except Exception:  # memory state may be broken after a crash; still tell every client
                req.finish_reason = {"type": "abort", "matched": None, "message": message}
                outputs.append(self._make_output(req))
        while True:  # requests submitted but never received
            try:
                greq = self.inbox.get_nowait()
            except queue.Empty:
                break
            if greq is not None:
                for i in range(greq.sampling_params.n):
                    outputs.append(
                        ReqOutput(
                            greq.rid,
                            i,
                            "",
                            [],
                            None,
                            {"type": "abort", "matched": None, "message": message},
                            len(greq.input_ids),
                            0,
                            0,
                        )
                    )
        if outputs:
            self.emit(outputs)

    # ----------------------------------------------------------------------------------------------------------
    # admission (prefill)
    def _available_tokens(self) -> int:
        return self.allocator.available() + self.cache.evictable_size()

    def _decode_reserve(self, reqs: list[Req]) -> int:
        total = 0
        for r in reqs:
            remaining = self._max_new_tokens(r) - len(r.output_ids)
            total += int(min(max(remaining, 0), DECODE_RESERVE_CLIP) * DECODE_RESERVE_RATIO) * max(r.num_samples, 1)
        return total

    def _max_new_tokens(self, req: Req) -> int:
        m = req.params.max_new_tokens
        return self.config.context_length - len(req.origin_input_ids) if m is None else m

    def _get_prefill_batch(self) -> list[Req]:
        cfg = self.config
        if not self.waiting and self.chunked_req is None:
            return []
        batch: list[Req] = []
        budget = cfg.max_prefill_tokens
        reserve = self._decode_reserve(self.running)
        num_running = len(self.running)

        if self.chunked_req is not None:
            req = self.chunked_req
            self.chunked_req = None
            self._schedule_extend(req, budget)
            budget -= req.extend_len
            batch.append(req)
            num_running += req.num_samples
            if req.kv_len + req.extend_len < len(req.fill_ids):
                self.chunked_req = req  # still more chunks to go
                return batch

        for req in order_waiting(self.waiting, cfg.schedule_policy, self.cache):
            if budget <= 0 or num_running + req.num_samples > cfg.max_running_requests:
                break
            match = self.cache.match_prefix(req.fill_ids[:-1]) if not self.cache.disable else None
            prefix = len(match.slots) if match is not None else 0
            need = len(req.fill_ids) - prefix
            chunk = min(need, budget, cfg.chunked_prefill_size)
            if chunk < need and chunk < min(cfg.chunked_prefill_size, need) and batch:
                break  # not enough budget left for a useful chunk; leave it for the next batch
            # Lock the prefix before measuring free memory: a locked prefix is no longer evictable, and counting it
            # as free would re-admit a just-retracted request only to retract it again (livelock).
            if match is not None:
                self.cache.inc_lock_ref(match.last_node)
            reserve_req = self._decode_reserve([req])
            free = self._available_tokens() - self._pending_extend_tokens(batch)
            if chunk + reserve + reserve_req > free and not (not batch and not self.running and chunk <= free):
                # (an empty engine admits what fits without the decode reserve: nothing else could free memory)
                if match is not None:
                    self.cache.dec_lock_ref(match.last_node)
                break
            self.waiting.remove(req)
            if not self._start_req(req, match):
                if match is not None:
                    self.cache.dec_lock_ref(match.last_node)
                self.waiting.insert(0, req)
                break
            self._schedule_extend(req, budget)
            budget -= req.extend_len
            reserve += reserve_req
            num_running += req.num_samples
            batch.append(req)
            if req.kv_len + req.extend_len < len(req.fill_ids):
                self.chunked_req = req
                break
        return batch

    def _pending_extend_tokens(self, batch: list[Req]) -> int:
        """Slots the admitted (not yet allocated) extends of ``batch`` will take, tokens."""
        return sum(r.extend_len for r in batch)

    def _start_req(self, req: Req, match: Any) -> bool:
        """Give ``req`` a req_to_token row and its cached prefix (``match``, already locked by the caller).

        False when no row is free."""
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return False
        req.req_pool_idx = idx
        req.last_node = match.last_node if match is not None else None
        req.prefix_len = len(match.slots) if match is not None else 0
        if req.prefix_len:
            self.req_to_token[idx, : req.prefix_len] = match.slots
        req.kv_len = req.prefix_len
        if not req.cached_tokens_set:
            req.cached_tokens = min(req.prefix_len, len(req.origin_input_ids))
            req.cached_tokens_set = True
            self.decode_stats.record_prompt(cached_tokens=req.cached_tokens * req.num_samples)
            if self.metrics is not None:
                self.metrics.cached_tokens_total.inc(req.cached_tokens * req.num_samples)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
            if self.metrics is not None:
                self.metrics.queue_time_seconds.observe(req.first_scheduled_time - req.arrival_time)
        return True

    def _schedule_extend(self, req: Req, budget: int) -> None:
        need = len(req.fill_ids) - req.kv_len
        req.extend_len = max(1, min(need, max(budget, 1), self.config.chunked_prefill_size))

    def _alloc_slots(self, n: int) -> torch.Tensor:
        """Allocate ``n`` KV slots, evicting unlocked radix-tree leaves if needed. Raises MemoryError if impossible."""
        if self.allocator.available() < n:
            self.cache.evict(n - self.allocator.available())
        slots = self.allocator.alloc(n)
        if slots is None:
            raise MemoryError(f"KV pool exhausted: need {n} slots, {self.allocator.available()} free")
        return slots

    # ----------------------------------------------------------------------------------------------------------
    # forward passes
    def _run_extend(self, batch: list[Req], outputs: list[ReqOutput]) -> None:
        for req in list(batch):
            try:
                slots = self._alloc_slots(req.extend_len)
            except MemoryError:
                # Should not happen thanks to admission control; put the request back rather than fail it.
                batch.remove(req)
                if self.chunked_req is req:
                    self.chunked_req = None
                req.extend_len = 0
                self._retract(req)
                continue
            self.req_to_token[req.req_pool_idx, req.kv_len : req.kv_len + req.extend_len] = slots
        if not batch:
            return
        input_ids: list[int] = []
        positions: list[int] = []
        out_loc: list[torch.Tensor] = []
        for req in batch:
            ids = req.fill_ids[req.kv_len : req.kv_len + req.extend_len]
            input_ids.extend(ids)
            positions.extend(range(req.kv_len, req.kv_len + req.extend_len))
            out_loc.append(self.req_to_token[req.req_pool_idx, req.kv_len : req.kv_len + req.extend_len])
        seq_lens = [r.kv_len + r.extend_len for r in batch]
        fb = self._forward_batch(
            ForwardMode.EXTEND, batch, input_ids, positions, torch.cat(out_loc), seq_lens, [r.extend_len for r in batch]
        )
        logits = self.runner.forward(fb)
        self.forward_count += 1

        done: list[tuple[int, Req]] = []
        for i, req in enumerate(batch):
            req.kv_len += req.extend_len
            req.extend_len = 0
            if req.kv_len < len(req.fill_ids):
                self._cache_unfinished(req)  # a chunk: make it reusable right away; the request continues
                continue
            done.append((i, req))
        if not done:
            return
        # Prefill finished: the prompt goes into the tree (so siblings and later requests hit it), then parents fork.
        rows: list[int] = []
        samplers: list[Req] = []
        for i, req in done:
            self._cache_unfinished(req)  # no-op with the radix cache disabled
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "matched": None}, outputs)
                continue
            children = self._fork(req) if req.num_samples > 1 else [req]
            for child in children:
                rows.append(i)
                samplers.append(child)
        if samplers:
            self._sample_and_process(logits[rows], samplers, outputs)
        for req in samplers:
            if not req.finished:
                self.running.append(req)

    def _run_decode(self, outputs: list[ReqOutput]) -> None:
        # Every running request needs one slot; retract the newest until that fits.
        while self.running and self._available_tokens() < len(self.running):
            victim = max(self.running, key=lambda r: (r.arrival_time, r.index))
            self.running.remove(victim)
            self._retract(victim)
        if not self.running:
            return
        t_step = time.perf_counter()
        self._step_grammar_s = 0.0
        batch = self.running
        slots = self._alloc_slots(len(batch))
        input_ids, positions = [], []
        for j, req in enumerate(batch):
            pos = req.seq_len - 1
            self.req_to_token[req.req_pool_idx, pos] = slots[j]
            input_ids.append(req.output_ids[-1])
            positions.append(pos)
        seq_lens = [r.seq_len for r in batch]
        fb = self._forward_batch(ForwardMode.DECODE, batch, input_ids, positions, slots, seq_lens, [1] * len(batch))
        logits = self.runner.forward(fb)
        self.forward_count += 1
        for req in batch:
            req.kv_len = req.seq_len
        constrained = sum(1 for r in batch if r.matcher is not None)
        size = len(batch)
        self._sample_and_process(logits, list(batch), outputs)
        self.running = [r for r in self.running if not r.finished]
        self.grammar_timing.add(size, constrained, time.perf_counter() - t_step, self._step_grammar_s)
        self.decode_stats.on_decode_step(size, t_step, self._decode_snapshot)

    def _forward_batch(
        self,
        mode: ForwardMode,
        batch: list[Req],
        input_ids: list[int],
        positions: list[int],
        out_loc: torch.Tensor,
        seq_lens: list[int],
        extend_lens: list[int],
    ) -> ForwardBatch:
        kv = [self.req_to_token[r.req_pool_idx, :n] for r, n in zip(batch, seq_lens)]
        indptr = [0]
        for n in seq_lens:
            indptr.append(indptr[-1] + n)
        dev = self.device
        return ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_cache_loc=out_loc.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int64, device=dev),
            kv_indptr=torch.tensor(indptr, dtype=torch.int64, device=dev),
            kv_indices=torch.cat(kv).to(dev),
            seq_lens_cpu=list(seq_lens),
            extend_seq_lens_cpu=list(extend_lens),
        )

    # ----------------------------------------------------------------------------------------------------------
    # sampling and finishing
    def _grammar_mask(self, reqs: list[Req]) -> Callable[[torch.Tensor], None] | None:
        """Fill the token bitmask of the constrained rows of ``reqs``; returns the logits processor applying it."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not rows:
            return None
        t0 = time.perf_counter()
        words = (self.runner.model_config.vocab_size + 31) // 32
        if self._token_bitmask is None or self._token_bitmask.shape[0] < len(reqs):
            self._token_bitmask = torch.full(
                (max(len(reqs), self.config.max_running_requests), words), -1, dtype=torch.int32
            )
        bitmask = self._token_bitmask
        for i in rows:
            reqs[i].matcher.fill_next_token_bitmask(bitmask, i)
        self._step_grammar_s += time.perf_counter() - t0

        def apply(logits: torch.Tensor) -> None:
            t1 = time.perf_counter()
            apply_token_bitmask(logits, bitmask, rows)
            self._step_grammar_s += time.perf_counter() - t1

        return apply

    def _sample_and_process(self, logits: torch.Tensor, reqs: list[Req], outputs: list[ReqOutput]) -> None:
        out = sample(
            logits.float(),
            [r.params for r in reqs],
            [r.output_ids for r in reqs],
            [r.origin_input_ids for r in reqs],
            [r.generator for r in reqs],
            [r.return_logprob for r in reqs],
            [r.top_logprobs_num for r in reqs],
            logits_processor=self._grammar_mask(reqs),
        )
        now = time.monotonic()
        for req, tok, lp in zip(reqs, out.next_token_ids, out.logprobs):
            grammar_done = False
            if req.matcher is not None:
                t0 = time.perf_counter()
                accepted = req.matcher.accept_token(tok)
                grammar_done = accepted and req.matcher.is_terminated()
                self._step_grammar_s += time.perf_counter() - t0
                if not accepted:
                    # The mask allowed only grammar tokens, so this is a bug (or a row with no allowed token):
                    # fail the request rather than continue unconstrained.
                    logger.error("grammar rejected token %d of %s", tok, req)
                    if self.metrics is not None:
                        self.metrics.grammar_aborts_total.inc()
                    if req in self.running:
                        self.running.remove(req)
                    self._finish(
                        req,
                        {
                            "type": "abort",
                            "matched": None,
                            "status_code": 500,
                            "message": f"constrained decoding failed: the grammar rejected token {tok}",
                        },
                        outputs,
                    )
                    continue
            req.output_ids.append(tok)
            if self.metrics is not None:
                self.metrics.generation_tokens_total.inc()
                if req.first_token_time is None:
                    self.metrics.time_to_first_token_seconds.observe(now - req.arrival_time)
                elif req.last_token_time is not None:
                    self.metrics.inter_token_latency_seconds.observe(now - req.last_token_time)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            req.pending_ids.append(tok)
            if lp is not None:
                req.pending_logprobs.append(lp)
            self._check_finish(req, tok, outputs, grammar_done)

    def _check_finish(self, req: Req, tok: int, outputs: list[ReqOutput], grammar_done: bool = False) -> None:
        p = req.params
        reason = None
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            reason = {"type": "stop", "matched": tok}
        elif grammar_done and tok in self.eos_token_ids:  # the grammar ended with eos (even under ignore_eos)
            reason = {"type": "stop", "matched": tok}
        else:
            text, matched = req.stop_matcher.feed(req.detokenizer.add_tokens([tok]))
            req.pending_text += text
            if matched is not None:
                reason = {"type": "stop", "matched": matched}
            elif grammar_done:  # the grammar ended without a stop token (cannot happen with xgrammar's stop ids)
                reason = {"type": "stop", "matched": None}
            elif len(req.output_ids) >= self._max_new_tokens(req) or req.seq_len >= self.config.context_length:
                reason = {"type": "length", "matched": None}
        if reason is not None:
            if req in self.running:
                self.running.remove(req)
            self._finish(req, reason, outputs)
        elif len(req.output_ids) % self.config.stream_interval == 0 or len(req.output_ids) == 1:
            outputs.append(self._make_output(req))

    def _finish(self, req: Req, reason: dict[str, Any], outputs: list[ReqOutput]) -> None:
        """Finish ``req``: flush held-back text (unless a stop string matched), release its KV, emit the last delta."""
        if not (reason["type"] == "stop" and isinstance(reason["matched"], str)):
            text, matched = req.stop_matcher.feed(req.detokenizer.flush())
            req.pending_text += text
            if matched is not None and reason["type"] != "abort":
                reason = {"type": "stop", "matched": matched}
            else:
                req.pending_text += req.stop_matcher.flush()
        req.finish_reason = reason
        req.matcher = None  # free the grammar state now; the Req object may outlive the request briefly
        self._release(req)
        outputs.append(self._make_output(req))
        if self.metrics is not None:
            self.metrics.num_requests_total.inc()
            if reason["type"] == "abort":
                self.metrics.num_aborted_requests_total.inc()
            self.metrics.e2e_request_latency_seconds.observe(time.monotonic() - req.arrival_time)

    def _make_output(self, req: Req) -> ReqOutput:
        out = ReqOutput(
            rid=req.rid,
            index=req.index,
            text=req.pending_text,
            token_ids=req.pending_ids,
            logprobs=req.pending_logprobs if req.return_logprob else None,
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
        )
        req.pending_text, req.pending_ids, req.pending_logprobs = "", [], []
        return out

    # ----------------------------------------------------------------------------------------------------------
    # KV bookkeeping
    def _fork(self, parent: Req) -> list[Req]:
        """Split a prefilled parent into ``n`` samples sharing its prompt KV (all of it is in the radix tree now)."""
        children = [parent]
        for i in range(1, parent.num_samples):
            child = Req(parent.greq, i, self.tokenizer, self._generator(parent.params.seed, i))
            idx = self.req_to_token_pool.alloc()
            assert idx is not None, "admission reserved a row per sample"
            child.req_pool_idx = idx
            child.prefix_len = parent.prefix_len
            child.kv_len = parent.kv_len
            child.last_node = parent.last_node
            child.cached_tokens = parent.cached_tokens
            child.cached_tokens_set = True
            child.first_scheduled_time = parent.first_scheduled_time
            child.num_samples = 1
            self.cache.inc_lock_ref(child.last_node)
            self.req_to_token[idx, : parent.kv_len] = self.req_to_token[parent.req_pool_idx, : parent.kv_len]
            children.append(child)
        parent.num_samples = 1
        return children

    def _cache_unfinished(self, req: Req) -> None:
        """Insert the request's computed KV into the radix tree and move its lock to the new deepest node."""
        if self.cache.disable:
            return
        row = req.req_pool_idx
        tokens = req.fill_ids[: req.kv_len]
        slots = self.req_to_token[row, : req.kv_len].clone()
        present = self.cache.insert(tokens, slots)
        if present > req.prefix_len:
            # The tree already had tokens [prefix_len, present) under other slots: ours are duplicates.
            self.allocator.free(slots[req.prefix_len : present])
        match = self.cache.match_prefix(tokens)
        assert len(match.slots) == req.kv_len, "inserted prefix must match in full"
        self.req_to_token[row, : req.kv_len] = match.slots
        if req.last_node is not None:
            self.cache.dec_lock_ref(req.last_node)
        self.cache.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        req.prefix_len = req.kv_len

    def _release(self, req: Req) -> None:
        """Return the request's KV: computed tokens go into the radix tree (reusable), the rest back to the pool."""
        if req.req_pool_idx is None:
            return
        row = req.req_pool_idx
        if self.cache.disable:
            if req.kv_len > 0:
                self.allocator.free(self.req_to_token[row, : req.kv_len].clone())
        else:
            slots = self.req_to_token[row, : req.kv_len].clone()
            present = self.cache.insert(req.fill_ids[: req.kv_len], slots)
            if present > req.prefix_len:
                self.allocator.free(slots[req.prefix_len : present])
            if req.last_node is not None:
                self.cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
        req.reset_kv_state()

    def _retract(self, req: Req) -> None:
        """Preempt ``req``: release its KV (cached for reuse) and put it back at the head of the queue."""
        self._release(req)
        self.waiting.insert(0, req)
        if self.metrics is not None:
            self.metrics.num_retracted_reqs_total.inc()
        logger.info("retracted %s: KV pool exhausted", req)

    # ----------------------------------------------------------------------------------------------------------
    # introspection / control (loop thread)
    def flush_cache(self) -> bool:
        """Drop every cached prefix. False (nothing done) while requests are in flight."""
        if self.running or self.waiting or self.chunked_req is not None:
            return False
        self.cache.reset()
        return True

    def used_tokens(self) -> int:
        """KV slots not free (held by requests or the radix tree), tokens."""
        return self.allocator.size - self.allocator.available()

    def _decode_snapshot(self) -> DecodeSnapshot:
        """The stats line's view of the engine (as the gauges: a chunked prefill counts as running)."""
        return DecodeSnapshot(
            running_reqs=len(self.running) + (1 if self.chunked_req is not None else 0),
            queued_reqs=len(self.waiting),
            used_tokens=self.used_tokens() - self.cache.evictable_size(),
            max_total_tokens=self.allocator.size,
        )

    def _update_gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        used = self.used_tokens()
        evictable = self.cache.evictable_size()
        m.num_running_reqs.set(len(self.running) + (1 if self.chunked_req is not None else 0))
        m.num_queue_reqs.set(len(self.waiting))
        m.num_used_tokens.set(used)
        m.num_evictable_tokens.set(evictable)
        m.max_total_num_tokens.set(self.allocator.size)
        m.token_usage.set((used - evictable) / max(self.allocator.size, 1))
