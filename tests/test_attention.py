"""Attention backends against a naive float64 reference over the slot-indexed KV pool (tiny random shapes, GQA)."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.engine.attention.base import create_attention_backend
from radixserve.engine.attention.torch_cpu import TorchBackend
from radixserve.engine.memory.kv_pool import KVPool
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode

HQ, HKV, D = 6, 2, 16
NUM_SLOTS = 200

torch.set_num_threads(min(2, torch.get_num_threads()))


def _reference(q, pool: KVPool, layer: int, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Naive attention in float64: per sequence, per new token, softmax over its context up to its own position."""
    k_buf, v_buf = pool.get_kv(layer)
    out = torch.empty(q.shape[0], HQ, D, dtype=torch.float64)
    q0 = 0
    for i in range(batch.batch_size):
        n_new, n_kv = batch.extend_seq_lens_cpu[i], batch.seq_lens_cpu[i]
        slots = batch.kv_indices[int(batch.kv_indptr[i]) : int(batch.kv_indptr[i + 1])]
        keys = k_buf[slots].double().repeat_interleave(HQ // HKV, dim=1)  # [L, HQ, D]
        vals = v_buf[slots].double().repeat_interleave(HQ // HKV, dim=1)
        for j in range(n_new):
            visible = n_kv - n_new + j + 1
            s = torch.einsum("hd,lhd->hl", q[q0 + j].double(), keys[:visible]) * scale
            out[q0 + j] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), vals[:visible])
        q0 += n_new
    return out.reshape(q.shape[0], HQ * D)


def _fill_pool(pool: KVPool, used: list[list[int]], dtype) -> None:
    """Random K/V in the given slots; slot 0 gets huge values so a padding leak would show."""
    for layer in range(pool.num_layers):
        for slots in used:
            idx = torch.tensor(slots, dtype=torch.int64)
            pool.set_kv(
                layer, idx, torch.randn(len(slots), HKV, D, dtype=dtype), torch.randn(len(slots), HKV, D, dtype=dtype)
            )
        pool.k_buffers[layer][0].fill_(1e3)
        pool.v_buffers[layer][0].fill_(1e3)


def _make_case(mode: ForwardMode, seed: int, dtype):
    """Sequences with random prefix/new lengths over scattered, non-contiguous slots."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = KVPool(NUM_SLOTS, 2, HKV, D, dtype, "cpu")
    free = list(range(1, NUM_SLOTS))
    rng.shuffle(free)
    specs = [(0, 7), (5, 3), (11, 1), (1, 9)] if mode == ForwardMode.EXTEND else [(4, 1), (17, 1), (1, 1), (30, 1)]
    slots, new_ids, prefixes = [], [], []
    for prefix, n_new in specs:
        s = [free.pop() for _ in range(prefix + n_new)]
        slots.append(s)
        new_ids.append([0] * n_new)
        prefixes.append(s[:prefix])
    _fill_pool(pool, prefixes, dtype)
    batch = ForwardBatch.build(mode, new_ids, slots)
    T = batch.num_tokens
    q = torch.randn(T, HQ, D, dtype=dtype)
    k = torch.randn(T, HKV, D, dtype=dtype)
    v = torch.randn(T, HKV, D, dtype=dtype)
    return pool, batch, q, k, v


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_torch_backend_matches_reference(mode, dtype, atol):
    pool, batch, q, k, v = _make_case(mode, seed=3, dtype=dtype)
    backend = TorchBackend(HQ, HKV, D)
    backend.init_forward_metadata(batch)
    for layer in range(2):
        out = backend.forward(q, k, v, layer, pool, batch)
        assert out.shape == (batch.num_tokens, HQ * D) and out.dtype == dtype
        # the new K/V landed in their slots
        torch.testing.assert_close(pool.k_buffers[layer][batch.out_cache_loc], k)
        torch.testing.assert_close(pool.v_buffers[layer][batch.out_cache_loc], v)
        ref = _reference(q, pool, layer, batch, D**-0.5)
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)


def test_decode_single_length_no_padding_path():
    """All sequences the same length takes the unpadded path; still matches the reference."""
    torch.manual_seed(0)
    pool = KVPool(64, 1, HKV, D, torch.float32, "cpu")
    slots = [[5, 9, 2, 40], [33, 7, 21, 3]]
    _fill_pool(pool, [s[:-1] for s in slots], torch.float32)
    batch = ForwardBatch.build(ForwardMode.DECODE, [[0], [0]], slots)
    q, k, v = torch.randn(2, HQ, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D)
    backend = TorchBackend(HQ, HKV, D)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, pool, batch)
    torch.testing.assert_close(out.double(), _reference(q, pool, 0, batch, D**-0.5), atol=1e-5, rtol=1e-5)


def test_factory_choices():
    assert isinstance(create_attention_backend("torch", HQ, HKV, D, torch.float32, "cpu"), TorchBackend)
    if not torch.cuda.is_available():
        assert isinstance(create_attention_backend("auto", HQ, HKV, D, torch.bfloat16, "cpu"), TorchBackend)
        with pytest.raises(ValueError):
            create_attention_backend("flashinfer", HQ, HKV, D, torch.bfloat16, "cpu")
    with pytest.raises(ValueError):
        create_attention_backend("nope", HQ, HKV, D, torch.float32, "cpu")
    with pytest.raises(ValueError):
        create_attention_backend("torch", 5, 2, D, torch.float32, "cpu")


def test_forward_batch_build_validates():
    b = ForwardBatch.build(ForwardMode.EXTEND, [[7, 8], [9]], [[3, 4, 5], [6]])
    assert b.positions.tolist() == [1, 2, 0] and b.out_cache_loc.tolist() == [4, 5, 6]
    assert b.kv_indptr.tolist() == [0, 3, 4] and b.batch_size == 2
    with pytest.raises(ValueError):
        ForwardBatch.build(ForwardMode.DECODE, [[1, 2]], [[3, 4]])
    with pytest.raises(ValueError):
        ForwardBatch.build(ForwardMode.EXTEND, [[1, 2]], [[3]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend_name", ["flashinfer", "torch"])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_cuda_backends_match_reference(backend_name, mode):
    if backend_name == "flashinfer":
        pytest.importorskip("flashinfer")
    dtype = torch.bfloat16
    pool, batch, q, k, v = _make_case(mode, seed=5, dtype=dtype)
    dev = torch.device("cuda")
    gpu_pool = KVPool(pool.size, pool.num_layers, HKV, D, dtype, dev)
    for layer in range(pool.num_layers):
        gpu_pool.k_buffers[layer].copy_(pool.k_buffers[layer])
        gpu_pool.v_buffers[layer].copy_(pool.v_buffers[layer])
    gbatch = ForwardBatch(
        **{
            f: (getattr(batch, f).to(dev) if isinstance(getattr(batch, f), torch.Tensor) else getattr(batch, f))
            for f in batch.__dataclass_fields__
        }
    )
    backend = create_attention_backend(backend_name, HQ, HKV, D, dtype, dev)
    backend.init_forward_metadata(gbatch)
    out = backend.forward(q.to(dev), k.to(dev), v.to(dev), 1, gpu_pool, gbatch).cpu()
    pool.set_kv(1, batch.out_cache_loc, k, v)
    ref = _reference(q, pool, 1, batch, D**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def _cascade_case(seed: int, dtype, shared: list[tuple[int, list[int]]], solo: list[int]):
    """A DECODE batch where groups of sequences share leading slots.

    ``shared``: per group, (shared prefix length, the total context length of each member); ``solo``: context lengths
    of sequences sharing nothing. Members of a group share exactly the first ``prefix`` slots and then diverge.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = KVPool(NUM_SLOTS * 4, 2, HKV, D, dtype, "cpu")
    free = list(range(1, NUM_SLOTS * 4))
    rng.shuffle(free)
    slots = []
    for prefix, members in shared:
        common = [free.pop() for _ in range(prefix)]
        slots += [common + [free.pop() for _ in range(n - prefix)] for n in members]
    slots += [[free.pop() for _ in range(n)] for n in solo]
    order = list(range(len(slots)))
    rng.shuffle(order)  # group members are not adjacent rows of the batch
    slots = [slots[i] for i in order]
    _fill_pool(pool, [s[:-1] for s in slots], dtype)
    batch = ForwardBatch.build(ForwardMode.DECODE, [[0]] * len(slots), slots)
    B = len(slots)
    return (
        pool,
        batch,
        torch.randn(B, HQ, D, dtype=dtype),
        torch.randn(B, HKV, D, dtype=dtype),
        torch.randn(B, HKV, D, dtype=dtype),
    )


CASCADE_CASES = {
    # prefix covers the whole context but the new token, for every sequence
    "all_but_one": ([(40, [41, 41, 41])], []),
    "short_prefix": ([(3, [9, 4, 20])], []),
    "one_token_prefix": ([(1, [2, 7])], []),
    "some_not_sharing": ([(25, [30, 26, 60])], [5, 33]),
    "two_groups": ([(12, [13, 40]), (50, [51, 52, 90, 55])], [1]),
    "unequal_suffix_padding": ([(20, [21, 70, 35, 22])], []),
}


@pytest.mark.parametrize("case", sorted(CASCADE_CASES))
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_decode_cascade_matches_reference(case, dtype, atol):
    shared, solo = CASCADE_CASES[case]
    pool, batch, q, k, v = _cascade_case(7, dtype, shared, solo)
    backend = TorchBackend(HQ, HKV, D, cascade_min_prefix=1)
    backend.init_forward_metadata(batch)
    # the cascade path is really taken, with each group's exact shared length
    assert sorted(g.length for g in backend._decode.groups) == sorted(p for p, _ in shared)
    for layer in range(2):
        out = backend.forward(q, k, v, layer, pool, batch)
        assert out.shape == (batch.batch_size, HQ * D) and out.dtype == dtype
        ref = _reference(q, pool, layer, batch, D**-0.5)
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)


def test_decode_cascade_partial_divergence_uses_longest_common_prefix():
    """Sequences with the same first slot but diverging at different points share only the common part."""
    torch.manual_seed(1)
    pool = KVPool(300, 1, HKV, D, torch.float32, "cpu")
    base = list(range(10, 90))
    slots = [base[:70] + [200, 201], base[:40] + [210, 211, 212], base[:75] + [220]]
    _fill_pool(pool, [s[:-1] for s in slots], torch.float32)
    batch = ForwardBatch.build(ForwardMode.DECODE, [[0]] * 3, slots)
    q, k, v = torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    backend = TorchBackend(HQ, HKV, D, cascade_min_prefix=8)
    backend.init_forward_metadata(batch)
    assert [g.length for g in backend._decode.groups] == [40]
    out = backend.forward(q, k, v, 0, pool, batch)
    torch.testing.assert_close(out.double(), _reference(q, pool, 0, batch, D**-0.5), atol=1e-5, rtol=1e-5)


def test_decode_cascade_thresholds():
    """Below the prefix-length or group-size threshold the plain path runs (and agrees with the cascade)."""
    pool, batch, q, k, v = _cascade_case(11, torch.float32, [(30, [40, 35])], [20])
    default = TorchBackend(HQ, HKV, D)  # 30 < default minimum prefix
    default.init_forward_metadata(batch)
    assert default._decode.groups == []
    too_few = TorchBackend(HQ, HKV, D, cascade_min_prefix=8, cascade_min_seqs=3)
    too_few.init_forward_metadata(batch)
    assert too_few._decode.groups == []
    cascade = TorchBackend(HQ, HKV, D, cascade_min_prefix=8)
    cascade.init_forward_metadata(batch)
    assert [g.length for g in cascade._decode.groups] == [30]
    plain = default.forward(q, k, v, 0, pool, batch)
    torch.testing.assert_close(cascade.forward(q, k, v, 0, pool, batch), plain, atol=1e-5, rtol=1e-5)


def _extend_cascade_case(
    seed: int, dtype, groups: list[tuple[int, list[tuple[int, int]]]], solo: list[tuple[int, int]]
):
    """An EXTEND batch where groups of sequences share leading cached slots.

    ``groups``: per group, (shared length, per member (cached prefix length >= shared, new tokens)); members share
    exactly the first ``shared`` slots, then have their own rest of prefix and new slots. ``solo``: (cached prefix,
    new) of sequences sharing nothing (prefix 0 = plain prefill). Rows are shuffled so members are not adjacent.
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pool = KVPool(NUM_SLOTS * 4, 2, HKV, D, dtype, "cpu")
    free = list(range(1, NUM_SLOTS * 4))
    rng.shuffle(free)
    specs = []  # (slots, new)
    for shared, members in groups:
        common = [free.pop() for _ in range(shared)]
        specs += [(common + [free.pop() for _ in range(p - shared + n)], n) for p, n in members]
    specs += [([free.pop() for _ in range(p + n)], n) for p, n in solo]
    rng.shuffle(specs)
    _fill_pool(pool, [s[: len(s) - n] for s, n in specs], dtype)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [[0] * n for _, n in specs], [s for s, _ in specs])
    T = batch.num_tokens
    return (
        pool,
        batch,
        torch.randn(T, HQ, D, dtype=dtype),
        torch.randn(T, HKV, D, dtype=dtype),
        torch.randn(T, HKV, D, dtype=dtype),
    )


EXTEND_CASCADE_CASES = {
    # the whole cached prefix is shared (the few-shot workload): the suffix part is only the causal new tokens
    "fewshot": ([(40, [(40, 5), (40, 1), (40, 9), (40, 3)])], []),
    # members own more cached slots after the shared part (partial prefix sharing)
    "partial_prefix": ([(20, [(20, 4), (35, 2), (27, 6)])], []),
    "some_not_sharing_and_no_prefix": ([(25, [(30, 3), (25, 7)])], [(0, 6), (12, 2), (0, 1), (25, 3)]),
    "two_groups": ([(12, [(12, 2), (30, 5)]), (50, [(51, 1), (50, 4), (60, 8)])], [(0, 4)]),
}


@pytest.mark.parametrize("case", sorted(EXTEND_CASCADE_CASES))
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_extend_cascade_matches_reference(case, dtype, atol):
    groups, solo = EXTEND_CASCADE_CASES[case]
    pool, batch, q, k, v = _extend_cascade_case(9, dtype, groups, solo)
    backend = TorchBackend(HQ, HKV, D, cascade_min_prefix=1)
    backend.init_forward_metadata(batch)
    # the cascade path is really taken, with each group's exact shared length and all its members' new tokens
    assert sorted(g.length for g in backend._extend_groups) == sorted(sh for sh, _ in groups)
    assert sorted(g.q_rows.numel() for g in backend._extend_groups) == sorted(sum(n for _, n in m) for _, m in groups)
    for layer in range(2):
        out = backend.forward(q, k, v, layer, pool, batch)
        assert out.shape == (batch.num_tokens, HQ * D) and out.dtype == dtype
        ref = _reference(q, pool, layer, batch, D**-0.5)
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)


def test_extend_cascade_shared_length_capped_at_cached_prefix():
    """Sequences over the same slot run share only up to the shortest cached prefix, never new tokens."""
    torch.manual_seed(2)
    pool = KVPool(300, 1, HKV, D, torch.float32, "cpu")
    base = list(range(10, 110))
    # identical leading 100 slots, but the first sequence's cached prefix ends at 60 (its new tokens are 60..63)
    slots = [base[:64], base[:80] + [200, 201], base[:70] + [210]]
    news = [4, 2, 1]
    _fill_pool(pool, [s[: len(s) - n] for s, n in zip(slots, news)], torch.float32)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [[0] * n for n in news], slots)
    T = batch.num_tokens
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, HKV, D), torch.randn(T, HKV, D)
    backend = TorchBackend(HQ, HKV, D, cascade_min_prefix=8)
    backend.init_forward_metadata(batch)
    assert [g.length for g in backend._extend_groups] == [60]
    plain = TorchBackend(HQ, HKV, D, cascade_min_seqs=4)  # group too small: per-sequence SDPA
    plain.init_forward_metadata(batch)
    assert plain._extend_groups == []
    out = backend.forward(q, k, v, 0, pool, batch)
    torch.testing.assert_close(out.double(), _reference(q, pool, 0, batch, D**-0.5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, plain.forward(q, k, v, 0, pool, batch), atol=1e-5, rtol=1e-5)


def _alone(batch: ForwardBatch, i: int, q, k, v):
    """Sequence ``i`` of ``batch`` as a batch of its own (same slots) with its rows of ``q``/``k``/``v``."""
    starts = [0]
    for n in batch.extend_seq_lens_cpu:
        starts.append(starts[-1] + n)
    lo, hi = int(batch.kv_indptr[i]), int(batch.kv_indptr[i + 1])
    one = ForwardBatch.build(batch.mode, [[0] * batch.extend_seq_lens_cpu[i]], [batch.kv_indices[lo:hi].tolist()])
    rows = slice(starts[i], starts[i + 1])
    return one, q[rows], k[rows], v[rows], rows


DETERMINISTIC_CASES = {
    "decode_groups_and_padding": (
        ForwardMode.DECODE,
        lambda dt: _cascade_case(7, dt, *CASCADE_CASES["two_groups"]),
    ),
    "decode_unequal_suffixes": (
        ForwardMode.DECODE,
        lambda dt: _cascade_case(7, dt, *CASCADE_CASES["unequal_suffix_padding"]),
    ),
    "extend_groups_and_plain": (
        ForwardMode.EXTEND,
        lambda dt: _extend_cascade_case(9, dt, *EXTEND_CASCADE_CASES["some_not_sharing_and_no_prefix"]),
    ),
    "extend_two_groups": (
        ForwardMode.EXTEND,
        lambda dt: _extend_cascade_case(9, dt, *EXTEND_CASCADE_CASES["two_groups"]),
    ),
}


@pytest.mark.parametrize("case", sorted(DETERMINISTIC_CASES))
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_deterministic_attention_of_a_sequence_does_not_depend_on_its_batch(case, dtype, atol):
    """--enable-deterministic-inference: every sequence's output is bitwise what it gets alone, in batches where the
    default backend would group shared prefixes (cascade) and pad decode contexts to the longest one."""
    mode, make = DETERMINISTIC_CASES[case]
    pool, batch, q, k, v = make(dtype)
    default = TorchBackend(HQ, HKV, D, cascade_min_prefix=1)
    default.init_forward_metadata(batch)
    det = TorchBackend(HQ, HKV, D, cascade_min_prefix=1, deterministic=True)
    det.init_forward_metadata(batch)
    if mode == ForwardMode.DECODE:
        assert default._decode is not None and default._decode.groups  # the default takes the cascade path here
        assert det._decode is None and len(det._decode_seqs) == batch.batch_size
    else:
        assert default._extend_groups and det._extend_groups == []
    out = det.forward(q, k, v, 1, pool, batch)
    torch.testing.assert_close(out.double(), _reference(q, pool, 1, batch, D**-0.5), atol=atol, rtol=atol)
    for i in range(batch.batch_size):
        one, qi, ki, vi, rows = _alone(batch, i, q, k, v)
        det.init_forward_metadata(one)
        assert torch.equal(det.forward(qi, ki, vi, 1, pool, one), out[rows]), f"sequence {i}"


def test_deterministic_decode_alone_is_the_default_batch_one_path():
    """A batch of one gives bitwise the same output with and without the flag (greedy output cannot change)."""
    pool, batch, q, k, v = _make_case(ForwardMode.DECODE, seed=4, dtype=torch.bfloat16)
    one, qi, ki, vi, _ = _alone(batch, 1, q, k, v)
    outs = []
    for det in (False, True):
        backend = TorchBackend(HQ, HKV, D, deterministic=det)
        backend.init_forward_metadata(one)
        outs.append(backend.forward(qi, ki, vi, 0, pool, one))
    assert torch.equal(outs[0], outs[1])


def test_factory_deterministic_picks_the_torch_backend():
    backend = create_attention_backend("auto", HQ, HKV, D, torch.bfloat16, "cpu", deterministic=True)
    assert isinstance(backend, TorchBackend) and backend.deterministic
    assert not create_attention_backend("torch", HQ, HKV, D, torch.float32, "cpu").deterministic
    with pytest.raises(ValueError, match="deterministic"):
        create_attention_backend("flashinfer", HQ, HKV, D, torch.bfloat16, "cpu", deterministic=True)
