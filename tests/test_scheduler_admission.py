"""Admission, retraction and KV accounting of the scheduler's parts, without a model or a forward.

``PrefillManager`` (budgets, chunked prefill, decode reserve, prefix match), ``DecodeManager`` (retraction) and
``KVCacheManager.cache_req`` run over a real slot allocator and a ``RadixCache`` or ``NoPrefixCache``; a "forward"
is simulated by marking the scheduled tokens computed (``kv_len += extend_len``).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from radixserve.engine.io_struct import GenerateRequest, SamplingParams
from radixserve.engine.memory.allocator import ReqToTokenPool, TokenSlotAllocator
from radixserve.engine.memory.no_prefix_cache import NoPrefixCache
from radixserve.engine.memory.radix_cache import RadixCache
from radixserve.engine.scheduler.cache import KVCacheManager
from radixserve.engine.scheduler.config import SchedulerConfig
from radixserve.engine.scheduler.decode import DecodeManager
from radixserve.engine.scheduler.finish import FinishKind, FinishReason
from radixserve.engine.scheduler.prefill import PrefillManager, decode_reserve
from radixserve.engine.scheduler.request import Req


def make_kv(slots: int, radix: bool = True, rows: int = 8, context: int = 256) -> KVCacheManager:
    alloc = TokenSlotAllocator(slots, check=True)  # debug mode: double frees and stray slots raise
    cache = RadixCache(alloc) if radix else NoPrefixCache(alloc)
    return KVCacheManager(alloc, ReqToTokenPool(rows, context + 1), cache)


def make_req(rid: str, prompt: list[int], max_new: int = 8, arrival: float = 1.0, n: int = 1) -> Req:
    greq = GenerateRequest(rid, prompt, SamplingParams(max_new_tokens=max_new, n=n), arrival_time=arrival)
    return Req(greq, 0, None, None)


def simulate_prefill(kv: KVCacheManager, batch: list[Req]) -> None:
    """What ``Scheduler._run_extend`` does around the forward: slots, then the computed KV into the cache."""
    for req in batch:
        kv.alloc_extend(req)
    for req in batch:
        req.kv_len += req.extend_len
        req.extend_len = 0
        kv.cache_req(req, finished=False)


def decode_one(kv: KVCacheManager, req: Req, tok: int) -> None:
    """One decode step of ``req``: a slot for its last token, then the token it "sampled"."""
    assert req.req_pool_idx is not None
    slot = kv.alloc_slots(1)
    kv.req_to_token[req.req_pool_idx, req.seq_len - 1] = slot[0]
    req.kv_len = req.seq_len
    req.output_ids.append(tok)


def test_no_prefix_cache_has_the_radix_cache_interface():
    public = {n for n, _ in inspect.getmembers(RadixCache) if not n.startswith("_")}
    assert public <= {n for n, _ in inspect.getmembers(NoPrefixCache) if not n.startswith("_")}
    alloc = TokenSlotAllocator(16)
    cache = NoPrefixCache(alloc)
    slots = alloc.alloc(3)
    assert slots is not None
    assert cache.insert([1, 2, 3], slots) == 0 and cache.match_prefix([1, 2, 3]).prefix_len == 0
    assert cache.total_size() == cache.evictable_size() == cache.evict(10) == 0
    with pytest.raises(ValueError, match="3 token ids but 2 slots"):
        cache.insert([1, 2, 3], slots[:2])


@pytest.mark.parametrize("radix", [True, False])
def test_cache_req_returns_every_slot_and_row(radix):
    kv = make_kv(64, radix)
    pm = PrefillManager(SchedulerConfig(context_length=256), kv)
    req = make_req("a", list(range(10, 30)))
    pm.add(req)
    batch = pm.schedule([])
    assert batch == [req] and req.extend_len == 20
    simulate_prefill(kv, batch)
    assert req.prefix_len == (20 if radix else 0)  # the tree owns the prompt now; without it the request does
    req.output_ids.append(6)  # the token sampled from the prefill's logits
    for tok in (7, 8):
        decode_one(kv, req, tok)
    assert kv.used_tokens() == 22  # 20 prompt + 2 decoded (the last token's KV is never computed)
    kv.cache_req(req, finished=True)
    assert req.req_pool_idx is None and req.kv_len == 0
    kv.check_idle()
    assert kv.cache.total_size() == (22 if radix else 0)  # reusable with a tree, all free without


def test_cache_req_frees_duplicates_of_a_prefix_cached_meanwhile():
    # Two requests with the same prompt prefilled in one batch: neither hit the other; the second insert finds the
    # first's tokens already in the tree and must free its own copies.
    kv = make_kv(64)
    pm = PrefillManager(SchedulerConfig(context_length=256), kv)
    a, b = make_req("a", list(range(1, 17)), arrival=1.0), make_req("b", list(range(1, 17)), arrival=2.0)
    pm.add(a)
    pm.add(b)
    batch = pm.schedule([])
    assert batch == [a, b]
    simulate_prefill(kv, batch)
    assert kv.cache.total_size() == 16 and kv.used_tokens() == 16  # b's 16 duplicate slots went back
    assert a.prefix_len == b.prefix_len == 16 and a.last_node is b.last_node
    assert a.req_pool_idx is not None and b.req_pool_idx is not None
    assert torch.equal(kv.req_to_token[b.req_pool_idx, :16], kv.req_to_token[a.req_pool_idx, :16])  # re-pointed
    for r in batch:
        kv.cache_req(r, finished=True)
    kv.check_idle()


def test_prefix_hit_prefills_only_the_rest_and_reports_cached_tokens():
    kv = make_kv(128)
    seen: list[tuple[str, bool, bool]] = []
    pm = PrefillManager(SchedulerConfig(context_length=256), kv, lambda r, c, f: seen.append((r.rid, c, f)))
    shared = list(range(100, 140))
    first = make_req("first", shared + [1, 2])
    pm.add(first)
    simulate_prefill(kv, pm.schedule([]))
    kv.cache_req(first, finished=True)
    second = make_req("second", shared + [3, 4, 5])
    pm.add(second)
    (admitted,) = pm.schedule([])
    assert admitted is second and second.prefix_len == 40 and second.extend_len == 3
    assert second.cached_tokens == 40
    assert seen == [("first", True, True), ("second", True, True)]
    simulate_prefill(kv, [second])
    kv.cache_req(second, finished=True)
    kv.check_idle()


def test_budget_chunks_a_long_prompt_and_the_chunk_continues_first():
    kv = make_kv(256)
    cfg = SchedulerConfig(context_length=256, max_prefill_tokens=64, chunked_prefill_size=48)
    pm = PrefillManager(cfg, kv)
    long, short = make_req("long", list(range(1, 121)), arrival=1.0), make_req("short", [5, 6, 7], arrival=2.0)
    pm.add(long)
    pm.add(short)
    chunks = []
    while long.kv_len < long.seq_len:
        batch = pm.schedule([])
        assert batch[0] is long and pm.chunked_req in (long, None)
        chunks.append(long.extend_len)
        simulate_prefill(kv, batch)
        if pm.chunked_req is None:
            break
    assert chunks == [48, 48, 24] and short in batch  # the last chunk leaves budget for the short prompt
    assert long.prefix_len == 120  # every chunk went into the tree as it finished
    for r in (long, short):
        kv.cache_req(r, finished=True)
    kv.check_idle()


def test_max_running_requests_caps_admission():
    kv = make_kv(256)
    pm = PrefillManager(SchedulerConfig(context_length=256, max_running_requests=3), kv)
    reqs = [make_req(f"r{i}", [i + 1, 50, 60], arrival=float(i + 1)) for i in range(5)]
    for r in reqs:
        pm.add(r)
    running = [make_req("old", [9, 9])]
    assert pm.schedule(running) == reqs[:2]  # one already running + two new = 3
    assert pm.waiting == reqs[2:]


def test_decode_reserve_holds_back_room_for_running_requests():
    # 100 slots; a running request with 200 tokens to go reserves 0.3 * 200 = 60; a 50-token prompt (+ its own
    # reserve of 0.3 * 8 = 2) no longer fits, though 100 slots are free.
    kv = make_kv(100)
    pm = PrefillManager(SchedulerConfig(context_length=512), kv)
    runner = make_req("running", [1], max_new=200)
    assert decode_reserve([runner], 512) == 60
    pm.add(make_req("new", list(range(1, 51))))
    assert pm.schedule([runner]) == []
    assert kv.cache.protected_size() == 0  # the refused request's lock was dropped
    assert [r.rid for r in pm.schedule([])] == ["new"]  # an empty engine admits what fits, reserve or not


def test_a_retracted_prefix_is_locked_before_free_memory_is_measured():
    # Regression (livelock): counting the request's own cached prefix as evictable re-admitted it at once, only to
    # retract it again. 48 slots, the request's 30-token prompt cached and unlocked: free + evictable = 48. Once its
    # 29-token prefix is locked only 18 free + 1 evictable remain: its 1 new token + its own reserve (2) + a running
    # request's reserve fit for 0.3 * 40 = 12 (15 <= 19), not for 0.3 * 60 = 18 (21 > 19; 21 <= 48 unlocked).
    kv = make_kv(48)
    pm = PrefillManager(SchedulerConfig(context_length=512), kv)
    prompt = list(range(1, 31))
    req = make_req("r", prompt)
    pm.add(req)
    simulate_prefill(kv, pm.schedule([]))
    kv.cache_req(req, finished=True)  # retracted: its prompt stays cached, unlocked
    pm.requeue(req)
    assert kv.available_size() == 48
    assert pm.schedule([make_req("big", [1], max_new=60)]) == []
    assert kv.cache.protected_size() == 0
    (again,) = pm.schedule([make_req("small", [1], max_new=40)])
    assert again is req and req.prefix_len == 29 and req.extend_len == 1
    simulate_prefill(kv, [req])
    kv.cache_req(req, finished=True)
    kv.check_idle()


@pytest.mark.parametrize("radix", [True, False])
def test_retraction_frees_the_newest_and_keeps_its_output(radix):
    # 30 slots, three 8-token prompts decoding: after 2 tokens each (3 x 10 = 30 used) one more step needs 3 slots.
    kv = make_kv(30, radix)
    pm = PrefillManager(SchedulerConfig(context_length=256), kv)
    dm = DecodeManager()
    reqs = [make_req(f"r{i}", [10 * i + k for k in range(1, 9)], max_new=1, arrival=float(i + 1)) for i in range(3)]
    for r in reqs:
        pm.add(r)
    batch = pm.schedule([])
    assert batch == reqs
    simulate_prefill(kv, batch)
    for r in reqs:
        r.output_ids.append(1)  # the prefill's sampled token
        dm.add(r)
    for tok in (2, 3):
        for r in reqs:
            decode_one(kv, r, tok)
    assert kv.allocator.available() == 0
    retracted: list[Req] = []

    def retract(r: Req) -> None:
        kv.cache_req(r, finished=True)
        pm.requeue(r)
        retracted.append(r)

    victims = dm.retract_until_fits(kv, retract)
    # With a tree the victim's KV stays cached but evictable (room for the others); without, it is freed.
    assert victims == retracted == [reqs[2]]
    assert dm.running == reqs[:2] and pm.waiting[0] is reqs[2]
    assert reqs[2].output_ids == [1, 2, 3] and reqs[2].req_pool_idx is None
    assert kv.available_size() >= len(dm.running)
    # The victim resumes: with a tree it hits everything it had computed.
    for r in dm.running:
        kv.cache_req(r, finished=True)
    dm.running.clear()
    (resumed,) = pm.schedule([])
    assert resumed is reqs[2] and resumed.prefix_len == (10 if radix else 0)  # 8 prompt + 2 computed outputs
    simulate_prefill(kv, [resumed])
    kv.cache_req(resumed, finished=True)
    kv.check_idle()


def test_finish_reason_wire_form():
    assert FinishReason.stop(2).to_dict() == {"type": "stop", "matched": 2}
    assert FinishReason.stop("END").matched_stop_string and not FinishReason.stop(2).matched_stop_string
    assert FinishReason.length().to_dict() == {"type": "length", "matched": None}
    assert FinishReason.abort("aborted").to_dict() == {"type": "abort", "matched": None, "message": "aborted"}
    assert FinishReason.abort("bad", 400).to_dict() == {
        "type": "abort",
        "matched": None,
        "message": "bad",
        "status_code": 400,
    }
    assert FinishReason.abort("x").kind is FinishKind.ABORT


def test_fork_shares_the_prompt_and_each_child_holds_its_own_lock():
    kv = make_kv(64)
    pm = PrefillManager(SchedulerConfig(context_length=256), kv)
    parent = make_req("p", list(range(1, 13)), n=3)
    assert parent.num_samples == 3
    pm.add(parent)
    simulate_prefill(kv, pm.schedule([]))
    children = [make_req("p", [], n=1) for _ in range(2)]
    for c in children:
        c.origin_input_ids = parent.origin_input_ids
        kv.fork(parent, c)
    rows = {parent.req_pool_idx, *(c.req_pool_idx for c in children)}
    assert len(rows) == 3
    for c in children:
        assert c.req_pool_idx is not None and parent.req_pool_idx is not None
        assert torch.equal(kv.req_to_token[c.req_pool_idx, :12], kv.req_to_token[parent.req_pool_idx, :12])
    assert kv.used_tokens() == 12  # one copy of the prompt
    for r in [parent, *children]:
        assert kv.cache.protected_size() == 12
        kv.cache_req(r, finished=True)
    kv.check_idle()
