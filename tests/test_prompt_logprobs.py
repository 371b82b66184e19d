"""Prompt-token logprobs (``GenerateRequest.logprob_start_len``) through the engine, against a reference forward.

The reference is Hugging Face transformers' own Llama forward over the whole prompt at once (float32, the same tiny
checkpoint), so the engine's values are checked against code that shares nothing with its forward: every prompt
token's logprob and top-k, for a plain prompt, a prompt already in the radix cache, chunked prefill, a start in the
middle, beside requests that ask for none, and ``select``'s one batch of ``prefix + choice`` prompts, whose prefix
must be prefilled once. The tiny checkpoint's tied embedding is scaled up so its next-token distributions are peaked
(a random init is nearly uniform, where an off-by-one position would hide in the noise).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.engine.config import EngineArgs
from radixserve.engine.engine import Engine
from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, ReqOutput, SamplingParams, TokenLogprob
from radixserve.engine.memory.allocator import ReqToTokenPool, TokenSlotAllocator
from radixserve.engine.memory.no_prefix_cache import NoPrefixCache
from radixserve.engine.memory.radix_cache import RadixCache
from radixserve.engine.model.logits import score_hidden_states
from radixserve.engine.scheduler.cache import KVCacheManager
from radixserve.engine.scheduler.config import SchedulerConfig
from radixserve.engine.scheduler.prefill import PrefillManager
from radixserve.engine.scheduler.request import Req

from tiny_model import write_tiny_model

ATOL = 2e-3  # logprobs span ~20 nats here; two float32 forwards agree to ~1e-4
EMBED_SCALE = 20.0
TOP_K = 5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from safetensors.torch import load_file, save_file

    path = write_tiny_model(tmp_path_factory.mktemp("tiny-llama-logprobs"))
    weights_file = Path(path) / "model.safetensors"
    weights = load_file(weights_file)
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * EMBED_SCALE  # tied: the LM head too
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def reference(tiny_model: str) -> Any:
    """``ref(ids)``: float32 ``[len(ids), vocab]`` log_softmax of HF's logits over the whole prompt (row ``p``
    predicts token ``p + 1``)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return ref


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Engine]:
    args = EngineArgs(
        model_path=tiny_model,
        device="cpu",
        dtype="float32",
        max_total_tokens=4096,
        context_length=512,
        num_threads=1,
        cpu_omp_threads_bind="nobind",
    )
    eng = Engine(args)
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture
def fresh(engine: Engine) -> Engine:
    """The engine with an empty radix cache."""
    assert engine.scheduler.call(engine.scheduler.flush_cache)
    return engine


@contextmanager
def chunked(engine: Engine, size: int) -> Iterator[None]:
    """Prefill in chunks of ``size`` tokens (and batches of at most ``size``) meanwhile."""
    cfg = engine.scheduler.config
    saved = (cfg.chunked_prefill_size, cfg.max_prefill_tokens)

    def set_sizes(chunk: int, budget: int) -> None:
        cfg.chunked_prefill_size, cfg.max_prefill_tokens = chunk, budget

    engine.scheduler.call(lambda: set_sizes(size, size))
    try:
        yield
    finally:
        engine.scheduler.call(lambda: set_sizes(*saved))


def extend_steps(engine: Engine) -> int:
    """Prefill steps run so far (read on the loop thread: a step's timing is counted after its outputs went out)."""
    return int(engine.scheduler.call(lambda: engine.scheduler.step_timing.extend.steps))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def request(ids: list[int], start: int | None, max_new: int = 2, **kw: Any) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, n=kw.pop("n", 1))
    return GenerateRequest(uuid.uuid4().hex, ids, params, logprob_start_len=start, top_logprobs_num=TOP_K, **kw)


def run(engine: Engine, reqs: list[GenerateRequest]) -> list[list[ReqOutput]]:
    """Submit ``reqs`` together; each one's deltas, in order."""

    async def collect(req: GenerateRequest) -> list[ReqOutput]:
        return [out async for out in engine.generate(req)]

    async def go() -> list[list[ReqOutput]]:
        # a request that never finishes fails here instead of hanging the suite
        return await asyncio.wait_for(asyncio.gather(*[collect(r) for r in reqs]), timeout=60)

    return asyncio.run(go())


def prompt_logprobs(outs: list[ReqOutput], index: int = 0) -> list[TokenLogprob | None]:
    """The sample's prompt logprobs: on its first delta, on no other."""
    mine = [o for o in outs if o.index == index]
    assert mine[0].input_token_logprobs is not None
    assert all(o.input_token_logprobs is None for o in mine[1:])
    return mine[0].input_token_logprobs


def check(entries: list[TokenLogprob | None], ids: list[int], start: int, ref: torch.Tensor) -> None:
    """``entries`` are the logprobs of ``ids[start:]`` under ``ref`` (``reference(ids)``), with its top-k."""
    assert len(entries) == len(ids) - start
    for pos, entry in zip(range(start, len(ids)), entries):
        if pos == 0:
            assert entry is None
            continue
        assert entry is not None, f"position {pos}"
        row = ref[pos - 1]
        assert entry.token_id == ids[pos]
        assert entry.logprob == pytest.approx(float(row[ids[pos]]), abs=ATOL), f"position {pos}"
        vals, idx = torch.topk(row, TOP_K)
        assert [t for t, _ in entry.top] == idx.tolist(), f"position {pos}"
        assert [v for _, v in entry.top] == pytest.approx(vals.tolist(), abs=ATOL)
        # the top-k is consistent with the token's own logprob: it is in the list with that value, or below it
        ranked = dict(entry.top)
        if entry.token_id in ranked:
            assert ranked[entry.token_id] == pytest.approx(entry.logprob, abs=1e-6)
        else:
            assert entry.logprob <= entry.top[-1][1] + 1e-6


def test_score_hidden_states_in_chunks_equals_one_log_softmax():
    torch.manual_seed(0)
    hidden = torch.randn(10, 8)
    head = torch.randn(50, 8) * 3
    targets = torch.randint(0, 50, (10,))
    out = score_hidden_states(hidden, lambda h: h @ head.T, targets, top_k=4, chunk_rows=3)
    full = torch.log_softmax(hidden @ head.T, dim=-1)
    torch.testing.assert_close(out.token_logprobs, full.gather(1, targets[:, None]).squeeze(1))
    vals, idx = torch.topk(full, 4)
    torch.testing.assert_close(out.top_logprobs, vals)
    assert torch.equal(out.top_ids, idx)
    assert score_hidden_states(hidden, lambda h: h @ head.T, targets, top_k=0).top_ids.shape == (10, 0)


def test_plain_prompt_every_token_matches_the_reference(fresh, reference):
    ids = prompt(40, seed=1)
    (outs,) = run(fresh, [request(ids, start=0, max_new=3)])
    entries = prompt_logprobs(outs)
    assert entries[0] is None and len(entries) == 40
    check(entries, ids, 0, reference(ids))
    assert sum(len(o.token_ids) for o in outs) == 3


def test_start_in_the_middle_scores_from_there(fresh, reference):
    ids = prompt(40, seed=2)
    (outs,) = run(fresh, [request(ids, start=17)])
    entries = prompt_logprobs(outs)
    assert len(entries) == 23 and entries[0] is not None  # position 17 has its logprob (SGLang leaves it null)
    check(entries, ids, 17, reference(ids))
    (last,) = run(fresh, [request(ids, start=39)])  # the last prompt token alone
    check(prompt_logprobs(last), ids, 39, reference(ids))


def test_a_cached_prompt_is_recomputed_from_the_start_position(fresh, reference):
    ids = prompt(48, seed=3)
    (plain,) = run(fresh, [request(ids, start=None)])  # caches the whole prompt (and its outputs)
    assert plain[0].input_token_logprobs is None
    (warm,) = run(fresh, [request(ids, start=20)])
    assert warm[-1].cached_tokens == 19  # the match stops where scoring starts: position 19 scores token 20
    check(prompt_logprobs(warm), ids, 20, reference(ids))
    (again,) = run(fresh, [request(ids, start=0)])
    assert again[-1].cached_tokens == 0
    check(prompt_logprobs(again), ids, 0, reference(ids))
    (nolp,) = run(fresh, [request(ids, start=None)])
    assert nolp[-1].cached_tokens == 47  # without prompt logprobs the whole prompt but its last token hits


def test_chunked_prefill_scores_every_chunk(fresh, reference):
    ids = prompt(45, seed=4)
    ref = reference(ids)
    steps = extend_steps(fresh)
    with chunked(fresh, 8):
        (outs,) = run(fresh, [request(ids, start=0)])
        assert extend_steps(fresh) - steps >= 6  # 45 tokens in chunks of 8
        check(prompt_logprobs(outs), ids, 0, ref)
        # a start inside the third chunk, behind the now cached prompt: chunks again from position 12
        (mid,) = run(fresh, [request(ids, start=13)])
        assert mid[-1].cached_tokens == 12
        check(prompt_logprobs(mid), ids, 13, ref)


def test_requests_without_logprobs_beside_one_with_them_are_unchanged(fresh, reference):
    others = [prompt(n, seed=10 + n) for n in (9, 23, 31)]
    alone = [[t for o in outs for t in o.token_ids] for outs in run(fresh, [request(p, None, 6) for p in others])]
    assert fresh.scheduler.call(fresh.scheduler.flush_cache)
    ids = prompt(37, seed=5)
    steps = extend_steps(fresh)
    plain = [request(p, None, 6) for p in others]
    results = run(fresh, plain[:2] + [request(ids, 0, 6)] + plain[2:])
    assert extend_steps(fresh) - steps == 1  # one prefill batch for all four
    beside = [[t for o in outs for t in o.token_ids] for outs in results[:2] + results[3:]]
    assert beside == alone
    assert all(o.input_token_logprobs is None for outs in results[:2] + results[3:] for o in outs)
    check(prompt_logprobs(results[2]), ids, 0, reference(ids))


def test_parallel_samples_each_carry_the_prompt_logprobs(fresh, reference):
    ids = prompt(21, seed=6)
    (outs,) = run(fresh, [request(ids, start=4, max_new=2, n=3)])
    for i in range(3):
        check(prompt_logprobs(outs, i), ids, 4, reference(ids))


def test_parallel_samples_of_a_prompt_only_request_all_finish(fresh, reference):
    ids = prompt(30, seed=9)
    (outs,) = run(fresh, [request(ids, start=0, max_new=0, n=2)])
    assert sorted(o.index for o in outs if o.finished) == [0, 1]
    for i in range(2):
        check(prompt_logprobs(outs, i), ids, 0, reference(ids))


def scorer(rid: str, ids: list[int], start: int | None) -> Req:
    """A prompt-only scheduler request (no model: admission tests)."""
    return Req(GenerateRequest(rid, ids, SamplingParams(max_new_tokens=0), logprob_start_len=start), 0, None, None)


def prefilled(kv: KVCacheManager, batch: list[Req]) -> None:
    """What the scheduler does around a prefill forward: slots, then the computed KV into the cache."""
    for req in batch:
        kv.alloc_extend(req)
        req.kv_len += req.extend_len
        req.extend_len = 0
        kv.cache_req(req, finished=False)


@pytest.mark.parametrize("radix", [True, False])
def test_admission_caps_the_match_and_waits_for_a_shared_prefix_only_with_a_cache(radix):
    alloc = TokenSlotAllocator(512, check=True)
    kv = KVCacheManager(alloc, ReqToTokenPool(16, 257), RadixCache(alloc) if radix else NoPrefixCache(alloc))
    manager = PrefillManager(SchedulerConfig(context_length=256), kv)
    shared = list(range(3, 43))  # 40 tokens
    first = scorer("first", shared + [50, 51], None)
    manager.add(first)
    assert manager.schedule([]) == [first]
    prefilled(kv, [first])  # the whole prompt is cached now (with a radix cache)
    scorers = [scorer(f"s{i}", shared + [60 + i, 70 + i], 30) for i in range(3)]
    for req in scorers:
        manager.add(req)
    batch = manager.schedule([])
    # the prefix is cached, but a match stops at position 29, whose logits score token 30: all three hit it
    assert batch == scorers and [r.prefix_len for r in batch] == [29 if radix else 0] * 3
    prefilled(kv, batch)
    cold = [scorer(f"c{i}", list(range(100, 140)) + [60 + i, 70 + i], 40) for i in range(3)]
    for req in cold:
        manager.add(req)
    # 39 uncached shared tokens: with a cache the first prefills them and the others wait a step for them
    assert manager.schedule([]) == (cold[:1] if radix else cold)


def test_select_prefills_the_shared_prefix_once(fresh, reference):
    # select(choices): one request, text = [prefix + choice_i], logprob_start_len = the prefix's length,
    # max_new_tokens 0. The first prompt prefills the prefix; the others wait one step and hit it in the cache.
    prefix = prompt(64, seed=7)
    choices = [prompt(n, seed=20 + n) for n in (3, 5, 2, 4)]
    prompts = [prefix + c for c in choices]
    steps = extend_steps(fresh)
    results = run(fresh, [request(p, start=len(prefix), max_new=0) for p in prompts])
    assert extend_steps(fresh) - steps == 2
    cached = sorted(outs[-1].cached_tokens for outs in results)
    assert cached == [0, 63, 63, 63]  # the others recompute the prefix's last token, which scores choice token 0
    prefilled = sum(len(p) for p in prompts) - sum(cached)
    assert prefilled == len(prefix) + sum(len(c) for c in choices) + 3
    for p, outs in zip(prompts, results):
        assert len(outs) == 1 and outs[0].token_ids == []
        assert outs[0].finish_reason == {"type": "length", "matched": None}
        check(prompt_logprobs(outs), p, len(prefix), reference(p))


@pytest.mark.parametrize("start", [-1, 12, True])
def test_a_start_outside_the_prompt_is_a_400(engine, start):
    with pytest.raises(InvalidRequestError) as e:
        run(engine, [request(prompt(12, seed=8), start=start)])
    assert e.value.param == "logprob_start_len" and e.value.status_code == 400
