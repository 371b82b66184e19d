"""The whole scheduler loop over a stand-in model that checks KV addressing (no real model, no torch forward).

``KVCheckingRunner`` stores each new token in a fake KV pool at its ``out_cache_loc`` slot and "attends" by
reading every sequence's context back through ``kv_indices``; the next token is a hash of that context. A slot
pointing at the wrong token anywhere (a bad prefix hit, a lost chunk, a retraction that resumed wrongly) changes
the output, so greedy outputs must be identical with the radix cache on and off, with chunked prefill, under
retraction and in parallel sampling, and every slot must come back.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixserve.engine.io_struct import GenerateRequest, ReqOutput, SamplingParams
from radixserve.engine.model.forward_batch import ForwardBatch
from radixserve.engine.scheduler.scheduler import Scheduler, SchedulerConfig

VOCAB = 64
EOS = 2


class CharTokenizer:
    """Token ``i`` is the letter ``chr(97 + i % 26)``."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


class KVCheckingRunner:
    """A ``ModelRunner`` stand-in whose next token depends on the whole context as read through the KV slots."""

    def __init__(self, max_total_tokens: int, forward_sleep_s: float = 0.0):
        self.device = torch.device("cpu")
        self.max_total_tokens = max_total_tokens
        self.model_config = SimpleNamespace(vocab_size=VOCAB)
        self.forward_sleep_s = forward_sleep_s
        self.pool = torch.full((max_total_tokens + 1, 2), -1, dtype=torch.int64)  # slot -> (token, position)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        self.pool[fb.out_cache_loc, 0] = fb.input_ids
        self.pool[fb.out_cache_loc, 1] = fb.positions
        logits = torch.zeros(fb.batch_size, VOCAB)
        indptr = fb.kv_indptr.tolist()
        for i in range(fb.batch_size):
            ctx = self.pool[fb.kv_indices[indptr[i] : indptr[i + 1]]]
            n = ctx.shape[0]
            assert ctx[:, 1].tolist() == list(range(n)), "a KV slot holds another position's token"
            h = int((ctx[:, 0] * torch.arange(1, n + 1)).sum()) * 2654435761 % (2**31)
            logits[i, 3 + h % (VOCAB - 3)] = 1.0  # never eos
        if self.forward_sleep_s:
            time.sleep(self.forward_sleep_s)
        return logits


def make_scheduler(pool: int = 4096, **cfg: Any) -> tuple[Scheduler, list[ReqOutput]]:
    outputs: list[ReqOutput] = []
    cfg.setdefault("context_length", 512)
    sched = Scheduler(KVCheckingRunner(pool), CharTokenizer(), SchedulerConfig(**cfg), [EOS], outputs.extend)
    return sched, outputs


def run(sched: Scheduler, outputs: list[ReqOutput], prompts: list[list[int]], **params: Any) -> dict[Any, list[int]]:
    """Submit every prompt at once and step until all finish; token ids per (rid, index)."""
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True, **params}
    start = len(outputs)
    n = params.get("n", 1)
    for i, p in enumerate(prompts):
        sched.submit(GenerateRequest(f"p{i}", list(p), SamplingParams(**params)))
    with torch.inference_mode():
        for _ in range(1000):
            sched._recv(block=False)
            sched._process_aborts()
            sched.step()
            if sum(1 for o in outputs[start:] if o.finished) == n * len(prompts):
                break
    result: dict[Any, list[int]] = {}
    for o in outputs[start:]:
        result.setdefault((o.rid, o.index), []).extend(o.token_ids)
    sched.kv.check_idle()
    return result


SHARED = [5 + (i * 7) % 50 for i in range(40)]
PROMPTS = [SHARED + [10 + i, 20 + i, 30 + i] for i in range(4)]


@pytest.fixture(scope="module")
def reference() -> dict[Any, list[int]]:
    sched, outputs = make_scheduler(disable_radix_cache=True)
    ref = run(sched, outputs, PROMPTS)
    assert len(ref) == 4 and all(len(v) == 12 for v in ref.values())
    assert len({tuple(v) for v in ref.values()}) == 4  # distinct prompts, distinct outputs: the stub sees context
    return ref


def test_radix_cache_cold_and_warm_match_no_cache(reference):
    sched, outputs = make_scheduler()
    assert run(sched, outputs, PROMPTS) == reference
    assert run(sched, outputs, PROMPTS) == reference  # warm: prompts come from the tree
    last = [o for o in outputs if o.finished][-4:]
    assert all(o.cached_tokens >= len(PROMPTS[0]) - 1 for o in last)


def test_a_prefix_shared_within_one_batch_is_stored_once(reference):
    # All four prompts prefill in one batch, so none hits the others' shared 40 tokens: each caches its copy, and
    # the tree keeps the first. The pool is small enough that the freed copies are handed out again while the
    # requests decode, so a table still pointing at them would read another token's KV.
    sched, outputs = make_scheduler(pool=4 * 43 + 16)
    assert run(sched, outputs, PROMPTS) == reference
    assert sched.step_timing.extend.steps == 1
    assert sched.cache.total_size() == 40 + 4 * (3 + 11)


def test_chunked_prefill_matches(reference):
    sched, outputs = make_scheduler(chunked_prefill_size=8, max_prefill_tokens=8)
    assert run(sched, outputs, PROMPTS) == reference
    assert sched.step_timing.extend.steps >= 43 // 8  # the first prompt took several chunks, the rest hit it


@pytest.mark.parametrize("disable_radix_cache", [True, False])
def test_retraction_under_memory_pressure_keeps_output(reference, disable_radix_cache):
    # Room for the prompts but not for 12 decode tokens each: the newest are retracted and resume.
    pool = 4 * 43 + 16 if disable_radix_cache else 40 + 4 * 3 + 16
    sched, outputs = make_scheduler(pool=pool, disable_radix_cache=disable_radix_cache)
    retracted: list[str] = []
    real = sched._retract
    sched._retract = lambda r: (retracted.append(r.rid), real(r))[1]  # type: ignore[method-assign]
    assert run(sched, outputs, PROMPTS) == reference
    assert retracted


def test_parallel_samples_prefill_once_and_match_single_requests(reference):
    sched, outputs = make_scheduler()
    forwards = sched.forward_count
    out = run(sched, outputs, PROMPTS[:1], n=3)
    assert sorted(out) == [("p0", 0), ("p0", 1), ("p0", 2)]
    assert all(v == reference[("p0", 0)] for v in out.values())  # greedy: every sample is the single answer
    assert sched.forward_count - forwards == 1 + 11  # one prefill for all three, then 11 decode steps


def test_abort_mid_decode_frees_every_slot():
    sched, outputs = make_scheduler()
    sched.submit(GenerateRequest("a", PROMPTS[0], SamplingParams(max_new_tokens=100, ignore_eos=True)))
    with torch.inference_mode():
        for _ in range(5):
            sched._recv(block=False)
            sched.step()
        assert sched.running
        sched.abort("a")
        sched._recv(block=False)
        sched._process_aborts()
    assert outputs[-1].finish_reason == {"type": "abort", "matched": None, "message": "aborted"}
    assert not sched.running and not sched.waiting
    sched.kv.check_idle()


def test_stop_string_finishes_with_the_typed_reason_on_the_wire(reference):
    sched, outputs = make_scheduler()
    ref_text = CharTokenizer().decode(reference[("p0", 0)])
    word = ref_text[3:5]
    run(sched, outputs, PROMPTS[:1], stop=[word])
    last = outputs[-1]
    text = "".join(o.text for o in outputs)
    assert last.finish_reason == {"type": "stop", "matched": word}
    assert ref_text.startswith(text) and word not in text
    run(sched, outputs, PROMPTS[:1], max_new_tokens=0)
    assert outputs[-1].finish_reason == {"type": "length", "matched": None} and outputs[-1].token_ids == []


def test_the_step_split_covers_each_phase():
    sched, outputs = make_scheduler()
    sched.runner.forward_sleep_s = 0.002
    t0 = time.perf_counter()
    run(sched, outputs, PROMPTS)
    wall = time.perf_counter() - t0
    split = sched.step_timing.decode[4]
    assert split.steps == 11
    assert split.forward_s >= 11 * 0.002  # the stub sleeps in every forward
    assert split.sample_s > 0 and split.schedule_s > 0 and split.output_s > 0
    assert split.total_s + sched.step_timing.extend.total_s <= wall
    ms = split.per_step_ms()
    assert abs(ms["total"] - sum(ms[k] for k in ("forward", "sample", "schedule", "output"))) < 1e-9


@pytest.mark.parametrize("n", [1, 3])
def test_a_crash_in_a_prefill_forward_fails_that_batchs_requests(n):
    # Regression: a scheduler loop that crashed in a prefill forward failed the waiting and running requests but not
    # the batch being prefilled (out of `waiting`, not yet `running`): their clients hung until they gave up. And an
    # n > 1 request not yet forked into its samples finished only sample 0 (the engine waits for all n).
    sched, outputs = make_scheduler()

    def crash(fb: ForwardBatch) -> torch.Tensor:
        raise RuntimeError("boom in the forward")

    sched.runner.forward = crash  # type: ignore[method-assign]
    for i, p in enumerate(PROMPTS[:2]):
        sched.submit(GenerateRequest(f"c{i}", list(p), SamplingParams(max_new_tokens=4, n=n)))
    sched.start()
    deadline = time.monotonic() + 30
    while sum(o.finished for o in outputs) < 2 * n and time.monotonic() < deadline:
        time.sleep(0.01)
    sched.stop()
    finished = sorted((o.rid, o.index) for o in outputs if o.finished)
    assert finished == sorted((f"c{i}", j) for i in range(2) for j in range(n))
    for o in outputs:
        assert o.finish_reason is not None and o.finish_reason["type"] == "abort"
        assert "boom in the forward" in o.finish_reason["message"]
    assert not sched.alive and isinstance(sched.error, RuntimeError)
