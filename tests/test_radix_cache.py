"""Tests for the RadixAttention prefix cache: unit tests plus a hypothesis state machine against a naive model."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.engine.memory.allocator import TokenSlotAllocator
from radixserve.engine.memory.radix_cache import RadixCache, TreeNode


def make(size=32, disable=False):
    alloc = TokenSlotAllocator(size, check=True)
    return alloc, RadixCache(alloc, disable=disable)


def put(alloc, cache, tokens):
    """Allocate fresh slots for ``tokens``, insert, free the duplicates the tree already had. Returns the slots."""
    slots = alloc.alloc(len(tokens))
    k = cache.insert(tokens, slots)
    alloc.free(slots[:k])
    return slots, k


def walk(cache):
    """Independent view of the tree: ({prefix tuple: slot}, evictable, protected, [nodes])."""
    contents, evictable, protected, nodes = {}, 0, 0, []
    stack = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.key and child.key[0] == first and child.parent is node
            assert len(child.key) == child.value.numel()
            p = prefix
            for tok, slot in zip(child.key, child.value.tolist()):
                p = p + (tok,)
                contents[p] = slot
            if child.lock_ref > 0:
                protected += len(child.key)
            else:
                evictable += len(child.key)
            nodes.append(child)
            stack.append((child, p))
    return contents, evictable, protected, nodes


# ---------------------------------------------------------------------------------------------------------------------
# Unit tests


def test_match_on_empty_tree():
    _, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.slots.numel() == 0 and m.slots.dtype == torch.int64
    assert m.last_node is cache.root
    assert cache.match_prefix([]).last_node is cache.root


def test_insert_then_exact_and_longer_match():
    alloc, cache = make()
    slots, k = put(alloc, cache, [1, 2, 3])
    assert k == 0
    assert cache.total_size() == 3 and cache.evictable_size() == 3 and alloc.available() == 29
    m = cache.match_prefix([1, 2, 3])
    assert m.slots.tolist() == slots.tolist() and m.last_node.key == [1, 2, 3]
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.prefix_len == 3 and m.slots.tolist() == slots.tolist()


def test_partial_match_splits_node():
    alloc, cache = make()
    slots, _ = put(alloc, cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 9])
    assert m.slots.tolist() == slots[:2].tolist()
    assert m.last_node.key == [1, 2]
    assert [c.key for c in m.last_node.children.values()] == [[3, 4]]
    assert m.last_node.parent is cache.root
    assert cache.total_size() == 4
    # The split did not change what is cached.
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == slots.tolist()


def test_shared_prefix_of_two_sequences():
    alloc, cache = make()
    a, ka = put(alloc, cache, [1, 2, 3, 4])
    b, kb = put(alloc, cache, [1, 2, 5, 6])
    assert (ka, kb) == (0, 2)
    assert cache.total_size() == 6 and alloc.available() == 32 - 6
    (shared,) = cache.root.children.values()
    assert shared.key == [1, 2]
    assert sorted(c.key for c in shared.children.values()) == [[3, 4], [5, 6]]
    # b's duplicate slots for [1, 2] were freed by the caller; the tree keeps a's.
    assert cache.match_prefix([1, 2, 5, 6]).slots.tolist() == a[:2].tolist() + b[2:].tolist()
    assert cache.match_prefix([1, 2, 3, 4]).slots.tolist() == a.tolist()


def test_insert_returns_already_present_length():
    alloc, cache = make()
    put(alloc, cache, [5, 6, 7, 8])
    assert put(alloc, cache, [5, 6, 7, 8])[1] == 4
    assert put(alloc, cache, [5, 6])[1] == 2
    assert put(alloc, cache, [5, 6, 7, 8, 9])[1] == 4
    assert put(alloc, cache, [6])[1] == 0
    assert cache.total_size() == 6 and alloc.available() == 32 - 6


def test_insert_accepts_tensor_ids_and_rejects_length_mismatch():
    alloc, cache = make()
    slots = alloc.alloc(3)
    assert cache.insert(torch.tensor([4, 5, 6]), slots) == 0
    assert cache.match_prefix(torch.tensor([4, 5])).slots.tolist() == slots[:2].tolist()
    with pytest.raises(ValueError):
        cache.insert([1, 2], alloc.alloc(3))


def test_insert_copies_slots():
    alloc, cache = make()
    slots = alloc.alloc(3)
    expected = slots.tolist()
    row = slots.clone()
    cache.insert([1, 2, 3], row)
    row.fill_(0)
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == expected


def test_lock_protects_from_eviction():
    alloc, cache = make()
    a, _ = put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [7, 8])
    m = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == a.tolist()
    assert cache.match_prefix([7, 8]).prefix_len == 0
    assert alloc.available() == 32 - 3
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    assert cache.evict(1) == 3
    assert alloc.available() == 32


def test_lock_on_child_protects_ancestors_and_survives_split():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3, 4])
    put(alloc, cache, [1, 2, 9])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    cache.match_prefix([1, 2, 3, 7])  # splits the locked node [3, 4]
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    assert cache.evict(10) == 1
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 4
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)


def test_lru_evicts_oldest_leaf_first():
    alloc, cache = make()
    put(alloc, cache, [1, 1])
    put(alloc, cache, [2, 2])
    put(alloc, cache, [3, 3])
    cache.match_prefix([1, 1])  # [2, 2] is now the least recently used
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).prefix_len == 0
    assert cache.match_prefix([1, 1]).prefix_len == 2
    assert cache.match_prefix([3, 3]).prefix_len == 2
    # Now [3, 3] was touched after [1, 1]: [1, 1] goes next.
    assert cache.evict(1) == 2
    assert cache.match_prefix([1, 1]).prefix_len == 0
    assert cache.match_prefix([3, 3]).prefix_len == 2


def test_evict_cascades_to_parents_that_become_leaves():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4])
    put(alloc, cache, [9])
    cache.match_prefix([9])  # keep [9] the most recent
    assert cache.evict(3) == 4  # [3], [4], then their parent [1, 2]
    assert cache.match_prefix([1]).prefix_len == 0
    assert cache.match_prefix([9]).prefix_len == 1
    assert cache.total_size() == 1 and alloc.available() == 31


def test_evict_frees_less_when_not_enough_evictable():
    alloc, cache = make()
    put(alloc, cache, [1, 2])
    put(alloc, cache, [3, 4, 5])
    cache.inc_lock_ref(cache.match_prefix([3, 4, 5]).last_node)
    assert cache.evict(10) == 2
    assert cache.evict(10) == 0
    assert cache.evict(0) == 0


def test_reset_frees_everything_and_refuses_with_locks():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 5])
    node = cache.match_prefix([1, 5]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    assert cache.total_size() == 4
    cache.dec_lock_ref(node)
    cache.reset()
    assert cache.total_size() == 0 and not cache.root.children
    assert alloc.available() == 32
    assert sorted(alloc.free_slots().tolist()) == list(range(1, 33))


def test_disabled_cache():
    alloc, cache = make(disable=True)
    m = cache.match_prefix([1, 2, 3])
    assert m.prefix_len == 0 and m.last_node is cache.root
    cache.inc_lock_ref(m.last_node)
    cache.dec_lock_ref(m.last_node)
    with pytest.raises(AssertionError):
        cache.insert([1, 2, 3], alloc.alloc(3))
    assert cache.evict(10) == 0
    assert cache.total_size() == 0


def test_pretty_lists_nodes():
    alloc, cache = make()
    put(alloc, cache, [1, 2, 3])
    put(alloc, cache, [1, 2, 4])
    text = cache.pretty()
    assert "[1, 2]" in text and "[3]" in text and "[4]" in text


# ---------------------------------------------------------------------------------------------------------------------
# Property-based: random interleavings against a naive reference model

POOL = 40
SEQS = st.lists(st.integers(0, 3), min_size=1, max_size=10)


class RadixCacheMachine(RuleBasedStateMachine):
    """Reference: ``ref`` maps every cached prefix (tuple) to the slot of its last token (page size 1 = a trie)."""

    @initialize()
    def setup(self):
        self.alloc = TokenSlotAllocator(POOL, check=True)
        self.cache = RadixCache(self.alloc)
        self.ref: dict[tuple, int] = {}
        self.locks: list[tuple[TreeNode, tuple, list[int]]] = []  # (node, prefix, its slots)

    # -- reference helpers

    def ref_match(self, seq):
        slots = []
        for i in range(1, len(seq) + 1):
            slot = self.ref.get(tuple(seq[:i]))
            if slot is None:
                break
            slots.append(slot)
        return slots

    def sync_after_evict(self, freed_before):
        """Check an eviction only removed unlocked prefixes, and that their slots really became free."""
        contents = walk(self.cache)[0]
        assert contents.items() <= self.ref.items()  # nothing new, nothing remapped
        gone = [p for p in self.ref if p not in contents]
        free = set(self.alloc.free_slots().tolist())
        assert all(self.ref[p] in free for p in gone)
        assert len(free) == freed_before + len(gone)
        self.ref = contents

    def alloc_with_evict(self, n):
        slots = self.alloc.alloc(n)
        if slots is None:
            before = self.alloc.available()
            self.cache.evict(n - before)
            self.sync_after_evict(before)
            slots = self.alloc.alloc(n)
        if slots is not None:
            # Never hands out a slot the tree (locked or not) still holds.
            assert set(slots.tolist()).isdisjoint(self.ref.values())
            assert len(set(slots.tolist())) == n
        return slots

    # -- rules

    @rule(seq=SEQS)
    def insert_after_match(self, seq):
        """The scheduler's path: match, lock the prefix, allocate only the rest, insert, unlock."""
        m = self.cache.match_prefix(seq)
        assert m.slots.tolist() == self.ref_match(seq)
        self.cache.inc_lock_ref(m.last_node)
        new = self.alloc_with_evict(len(seq) - m.prefix_len)
        if new is not None:
            assert self.cache.match_prefix(seq[: m.prefix_len]).slots.tolist() == m.slots.tolist()
            k = self.cache.insert(seq, torch.cat([m.slots, new]))
            assert k == m.prefix_len
            for i in range(k, len(seq)):
                self.ref[tuple(seq[: i + 1])] = int(new[i - k])
        self.cache.dec_lock_ref(m.last_node)

    @rule(seq=SEQS)
    def insert_fresh_slots(self, seq):
        """Insert with all-new slots; the caller frees the duplicates the tree already had."""
        slots = self.alloc_with_evict(len(seq))
        if slots is None:
            return
        expected = len(self.ref_match(seq))
        k = self.cache.insert(seq, slots)
        assert k == expected
        self.alloc.free(slots[:k])
        for i in range(k, len(seq)):
            self.ref[tuple(seq[: i + 1])] = int(slots[i])

    @rule(seq=SEQS)
    def match(self, seq):
        m = self.cache.match_prefix(seq)
        assert m.slots.tolist() == self.ref_match(seq)
        depth, node = 0, m.last_node
        while node is not self.cache.root:
            depth += len(node.key)
            node = node.parent
        assert depth == m.prefix_len  # last_node ends exactly at the match

    @rule(seq=SEQS)
    def lock(self, seq):
        m = self.cache.match_prefix(seq)
        self.cache.inc_lock_ref(m.last_node)
        self.locks.append((m.last_node, tuple(seq[: m.prefix_len]), m.slots.tolist()))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _, _ = self.locks.pop(i)
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, POOL))
    def evict(self, n):
        evictable, available = self.cache.evictable_size(), self.alloc.available()
        freed = self.cache.evict(n)
        assert min(n, evictable) <= freed <= evictable
        assert self.alloc.available() == available + freed
        self.sync_after_evict(available)

    @rule()
    def reset(self):
        if any(prefix for _, prefix, _ in self.locks):  # a lock on the root (a miss) holds nothing
            with pytest.raises(RuntimeError):
                self.cache.reset()
        else:
            self.cache.reset()
            self.ref = {}
            assert self.alloc.available() == POOL

    # -- invariants

    @invariant()
    def consistent(self):
        contents, evictable, protected, nodes = walk(self.cache)
        assert contents == self.ref
        assert (evictable, protected) == (self.cache.evictable_size(), self.cache.protected_size())
        assert self.alloc.available() + evictable + protected == POOL
        free = self.alloc.free_slots().tolist()
        assert len(free) == len(set(free)) == self.alloc.available()
        tree_slots = list(self.ref.values())
        assert len(tree_slots) == len(set(tree_slots))
        assert sorted(free + tree_slots) == list(range(1, POOL + 1))  # no leak, no slot in two places
        # Every locked prefix is still cached with the same slots.
        for _, prefix, slots in self.locks:
            assert [self.ref[prefix[: i + 1]] for i in range(len(prefix))] == slots
        # lock_ref of each node = locks held on it or on a descendant.
        expected = {id(n): 0 for n in nodes}
        for node, _, _ in self.locks:
            while node.parent is not None:
                expected[id(node)] += 1
                node = node.parent
        assert all(n.lock_ref == expected[id(n)] for n in nodes)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for node, _, _ in self.locks:
            self.cache.dec_lock_ref(node)
        self.cache.evict(POOL + 1)
        assert self.cache.total_size() == 0
        assert sorted(self.alloc.alloc(POOL).tolist()) == list(range(1, POOL + 1))


RadixCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestRadixCacheMachine = RadixCacheMachine.TestCase
