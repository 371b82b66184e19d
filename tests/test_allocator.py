"""Tests for the KV slot allocator and the request -> token -> slot table."""

import pytest
import torch

from radixserve.engine.memory.allocator import ReqToTokenPool, TokenSlotAllocator


def test_alloc_hands_out_distinct_slots_excluding_zero():
    alloc = TokenSlotAllocator(10)
    got = alloc.alloc(10)
    assert got.dtype == torch.int64 and got.shape == (10,)
    assert sorted(got.tolist()) == list(range(1, 11))
    assert alloc.available() == 0


def test_alloc_too_many_returns_none_and_allocates_nothing():
    alloc = TokenSlotAllocator(8)
    first = alloc.alloc(5)
    assert alloc.alloc(4) is None
    assert alloc.available() == 3
    rest = alloc.alloc(3)
    assert set(first.tolist()).isdisjoint(rest.tolist())


def test_alloc_zero_and_negative():
    alloc = TokenSlotAllocator(4)
    assert alloc.alloc(0).numel() == 0
    assert alloc.available() == 4
    with pytest.raises(ValueError):
        alloc.alloc(-1)


def test_free_makes_slots_reusable_and_merges_pending():
    alloc = TokenSlotAllocator(6)
    a = alloc.alloc(4)
    alloc.free(a[:2])
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.available() == 4
    # Needs the 2 never-allocated slots plus the 2 pending frees.
    b = alloc.alloc(4)
    assert b is not None
    assert sorted(b.tolist() + a[2:].tolist()) == list(range(1, 7))
    assert alloc.available() == 0


def test_free_copies_its_argument():
    """Freeing a view of a table row must not change when the row is overwritten afterwards."""
    alloc = TokenSlotAllocator(4)
    row = torch.zeros(4, dtype=torch.int64)
    row[:] = alloc.alloc(4)
    expected = sorted(row.tolist())
    alloc.free(row[:])
    row.fill_(0)
    assert sorted(alloc.alloc(4).tolist()) == expected


def test_clear_restores_everything():
    alloc = TokenSlotAllocator(5)
    alloc.alloc(3)
    alloc.free(alloc.alloc(2))
    alloc.clear()
    assert alloc.available() == 5
    assert sorted(alloc.free_slots().tolist()) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("bad", [[0], [7], [1, 1]])
def test_check_mode_rejects_bad_slots(bad):
    alloc = TokenSlotAllocator(6, check=True)
    alloc.alloc(6)
    with pytest.raises(ValueError):
        alloc.free(torch.tensor(bad))


def test_check_mode_detects_double_free():
    alloc = TokenSlotAllocator(6, check=True)
    s = alloc.alloc(3)
    alloc.free(s[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(s[:2])
    # A never-allocated slot is free already, so freeing it is a double free too.
    never = sorted(set(range(1, 7)) - set(s.tolist()))[0]
    with pytest.raises(ValueError, match="double free"):
        alloc.free(torch.tensor([never]))
    # After realloc the slot can be freed again.
    alloc.clear()
    again = alloc.alloc(6)
    alloc.free(again)
    assert alloc.available() == 6


def test_req_to_token_pool_rows():
    pool = ReqToTokenPool(3, 16)
    assert pool.req_to_token.shape == (3, 16) and pool.req_to_token.dtype == torch.int64
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]
    assert pool.alloc() is None and pool.available() == 0
    pool.free(rows[1])
    assert pool.available() == 1
    assert pool.alloc() == rows[1]
    with pytest.raises(ValueError):
        pool.free(5)
    pool.free(rows[0])
    with pytest.raises(ValueError, match="double free"):
        pool.free(rows[0])
    pool.clear()
    assert pool.available() == 3
