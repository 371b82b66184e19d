"""RadixAttention prefix cache: a radix tree from token-id prefixes to the KV slots that hold them.

From SGLang (Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs", 2024;
python/sglang/srt/mem_cache/radix_cache.py) and mini-sglang (python/minisgl/kvcache/radix_cache.py). Page size 1.

Each edge holds a run of token ids (``key``) and the KV slots of those tokens (``value``); the path from the root to a
node spells a cached prefix. A request locks the node ending its matched prefix (``inc_lock_ref``), which protects that
node and all its ancestors from eviction; unlocked leaves are evicted in LRU order when the KV pool runs short.

Slot ownership: every slot held by a node belongs to the tree and goes back to the allocator only through ``evict`` or
``reset``. ``evictable_size() + protected_size()`` always equals the number of slots held by the tree.

Cache events (``cache_events.py``): with a ``CacheEventLog`` the tree names every full block of ``block_tokens``
tokens on a root-to-node path by its chained hash (``contracts/block_hash.py``, the router's scheme) and publishes the
blocks it starts or stops holding. A block that straddles a node boundary belongs to the node where it ends; each node
keeps the hashes of its blocks (``TreeNode.blocks``) and the digest to chain its children on (``chain_tail``), so an
``insert`` hashes only its new blocks (one blake2b each) and a split hashes nothing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from radixserve.contracts.block_hash import as_digest, chain_packed, namespace_digest, pack_token_ids
from radixserve.engine.memory.allocator import TokenSlotAllocator
from radixserve.engine.memory.cache_events import CacheEventLog


class TreeNode:
    """A radix tree node: the edge from ``parent`` carrying ``key`` (token ids) and ``value`` (their KV slots).

    Attributes:
        key: token ids of this edge, ``len(key) == len(value)``; empty only for the root.
        value: int64 ``[len(key)]`` KV slots.
        parent: ``None`` for the root.
        children: child nodes keyed by the first token id of their ``key``.
        lock_ref: number of locks held on this node or on a descendant (through ``inc_lock_ref``); > 0 = protected.
        last_access_time: value of the cache's monotonic counter at the last match/insert through this node.
        node_id: creation order, breaks LRU ties deterministically.
        depth: tokens on the path from the root to the end of this edge (0 for the root).
        blocks: with cache events, the wire hashes of the full blocks that end inside this edge (block ``j`` ends
            at token ``(j + 1) * block_tokens`` of the path), in order; else empty.
        chain_tail: with cache events, the digest of the last full block ending at or before ``depth`` (the
            namespace digest ``h_0`` when there is none): what a child's first block chains on; else None.
    """

    __slots__ = (
        "key",
        "value",
        "parent",
        "children",
        "lock_ref",
        "last_access_time",
        "node_id",
        "depth",
        "blocks",
        "chain_tail",
    )

    def __init__(
        self,
        key: list[int],
        value: torch.Tensor,
        parent: TreeNode | None,
        node_id: int,
        last_access_time: int = 0,
        lock_ref: int = 0,
        depth: int = 0,
    ):
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = lock_ref
        self.last_access_time = last_access_time
        self.node_id = node_id
        self.depth = depth
        self.blocks: list[int] = []
        self.chain_tail: bytes | None = None

    def is_leaf(self) -> bool:
        return not self.children

    def __lt__(self, other: TreeNode) -> bool:  # heap order for LRU eviction
        return (self.last_access_time, self.node_id) < (other.last_access_time, other.node_id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.node_id}, len={len(self.key)}, lock_ref={self.lock_ref}, t={self.last_access_time})"


@dataclass
class MatchResult:
    """Result of ``RadixCache.match_prefix``.

    Attributes:
        slots: int64 ``[prefix_len]`` KV slots of the longest cached prefix (empty on a miss).
        last_node: deepest node of the match (the root if none); lock it while a request uses the prefix.
    """

    slots: torch.Tensor
    last_node: TreeNode

    @property
    def prefix_len(self) -> int:
        """Number of matched tokens."""
        return self.slots.numel()


def _common_prefix_len(key: list[int], token_ids: list[int], start: int) -> int:
    """Length of the common prefix of ``key`` and ``token_ids[start:]``."""
    n = min(len(key), len(token_ids) - start)
    if key[:n] == token_ids[start : start + n]:  # C-speed fast path: the whole edge matches
        return n
    i = 0
    while i < n and key[i] == token_ids[start + i]:
        i += 1
    return i


class RadixCache:
    """Radix tree prefix cache over KV slots (page size 1).

    Args:
        allocator: where evicted slots go back to.
        disable: no caching: ``match_prefix`` always misses (empty slots, the root), ``evict`` frees nothing, lock
            calls are no-ops on the root, and ``insert`` must not be called (the caller frees its slots itself).
        events: where to publish the full blocks the tree starts (``insert``) and stops (``evict``, ``reset``)
            holding, hashed in the namespace ``("tokens", events.model, None)``; None: no events, no hashing.

    Sizes (``evictable_size``, ``protected_size``) are kept incrementally: O(depth) per lock change, O(1) per split
    and insert.
    """

    def __init__(self, allocator: TokenSlotAllocator, disable: bool = False, events: CacheEventLog | None = None):
        self.allocator = allocator
        self.disable = disable
        self.events = events
        self._h0 = namespace_digest("tokens", events.model, None) if events is not None else None
        self._empty = torch.empty(0, dtype=torch.int64, device=allocator.device)
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode([], self._empty, None, next(self._ids))
        self.root.chain_tail = self._h0
        self._evictable = 0
        self._protected = 0

    # ----------------------------------------------------------------------------------------------------------------
    # Queries

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``token_ids``.

        When the match ends inside an edge, that node is split so ``last_node`` covers exactly the match. Every node on
        the path gets a fresh access time (LRU). The result's ``slots`` stay valid only while ``last_node`` is locked
        (or until the next ``evict``/``reset``); treat them as read-only (they may be views of the tree's tensors).

        Args:
            token_ids: token ids (list, tuple, or 1-D tensor).
        """
        if self.disable or len(token_ids) == 0:
            return MatchResult(self._empty, self.root)
        token_ids = _as_list(token_ids)
        now = next(self._clock)
        node = self.root
        values: list[torch.Tensor] = []
        pos = 0
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, token_ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            values.append(child.value)
            pos += n
            node = child  # after a split, the next lookup misses (or pos is at the end) and the loop ends
        slots = torch.cat(values) if len(values) > 1 else (values[0] if values else self._empty)
        return MatchResult(slots, node)

    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes (freeable by ``evict``)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens held by locked nodes (``lock_ref > 0``)."""
        return self._protected

    def total_size(self) -> int:
        """Tokens (= slots) held by the tree."""
        return self._evictable + self._protected

    # ----------------------------------------------------------------------------------------------------------------
    # Updates

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Cache ``token_ids -> slots``.

        Args:
            token_ids: token ids, length ``n``.
            slots: int64 ``[n]`` KV slots of those tokens.
        Returns:
            ``k``: number of leading tokens that were already in the tree. Their slots in the tree are kept; the tree
            takes ownership of ``slots[k:]`` (copied), and the caller still owns ``slots[:k]`` (it must free those it
            allocated itself, i.e. duplicates of cached tokens, as SGLang does).
        Raises:
            AssertionError: the cache is disabled.
            ValueError: ``len(token_ids) != len(slots)``.
        """
        assert not self.disable, "insert() on a disabled RadixCache: free the slots instead"
        if len(token_ids) != slots.numel():
            raise ValueError(f"{len(token_ids)} token ids but {slots.numel()} slots")
        token_ids = _as_list(token_ids)
        now = next(self._clock)
        node = self.root
        pos = 0
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                new = TreeNode(
                    token_ids[pos:],
                    slots[pos:].reshape(-1).to(dtype=torch.int64, copy=True),
                    node,
                    next(self._ids),
                    last_access_time=now,
                    depth=len(token_ids),
                )
                node.children[token_ids[pos]] = new
                self._evictable += len(new.key)
                if self.events is not None:
                    self._hash_new_blocks(new, node, token_ids, pos)
                break
            n = _common_prefix_len(child.key, token_ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            pos += n
            node = child
        return pos

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors against eviction. O(depth)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``. O(depth).

        Raises:
            RuntimeError: ``node`` is not locked.
        """
        if node.parent is not None and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots, if possible, from unlocked leaves in LRU order.

        A parent whose last child goes and which is unlocked becomes a candidate itself (cascade). Whole nodes are
        freed, so slightly more than asked may go. O(tree nodes) to collect leaves, O(log n) per evicted node.

        Returns:
            Tokens freed (less than asked only when nothing evictable is left).
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [n for n in self._iter_nodes() if n.is_leaf() and n.lock_ref == 0 and n.parent is not None]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        removed: list[int] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            node = heapq.heappop(heap)
            freed.append(node.value)
            removed.extend(node.blocks)
            num_freed += len(node.key)
            self._evictable -= len(node.key)
            parent = node.parent
            assert parent is not None  # the heap holds non-root nodes only
            del parent.children[node.key[0]]
            node.parent = None
            if parent.parent is not None and parent.lock_ref == 0 and parent.is_leaf():
                heapq.heappush(heap, parent)
        if freed:
            self.allocator.free(torch.cat(freed))
        if self.events is not None:
            self.events.removed(removed)
        return num_freed

    def reset(self) -> None:
        """Flush the cache: give every slot in the tree back to the allocator.

        Raises:
            RuntimeError: a lock is held (a running request still uses cached slots).
        """
        if self._protected > 0:
            raise RuntimeError(f"reset() with {self._protected} locked tokens in the radix cache")
        values = [n.value for n in self._iter_nodes() if n.parent is not None]
        if values:
            self.allocator.free(torch.cat(values))
        self._init_tree()
        if self.events is not None:
            self.events.cleared()

    # ----------------------------------------------------------------------------------------------------------------
    # Debugging

    def pretty(self) -> str:
        """Indented dump of the tree: one line per node with its key, slots, lock_ref and access time."""
        lines = [f"root evictable={self._evictable} protected={self._protected}"]

        def walk(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda c: c.key[0]):
                lines.append(
                    f"{'  ' * depth}{child.key} -> {child.value.tolist()} "
                    f"lock={child.lock_ref} t={child.last_access_time}"
                )
                walk(child, depth + 1)

        walk(self.root, 1)
        return "\n".join(lines)

    def _iter_nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _hash_new_blocks(self, new: TreeNode, parent: TreeNode, token_ids: list[int], start: int) -> None:
        """Hash and publish the full blocks ending inside ``new``'s edge, ``token_ids[start:]`` under ``parent``
        (``token_ids`` the whole path from the root): one blake2b per new block, chained on ``parent.chain_tail``."""
        assert self.events is not None and parent.chain_tail is not None
        bt = self.events.block_tokens
        first = start // bt * bt  # where the block that ends first in this edge begins (maybe in an ancestor)
        end = len(token_ids) // bt * bt
        if end <= first:  # no block ends inside this edge
            new.chain_tail = parent.chain_tail
            return
        new.blocks, new.chain_tail = chain_packed(parent.chain_tail, pack_token_ids(token_ids[first:end]), bt)
        self.events.stored(new.blocks)

    def _split(self, child: TreeNode, pos: int) -> TreeNode:
        """Split ``child`` at ``pos`` (0 < pos < len(key)); return the new upper node holding ``key[:pos]``.

        The upper node inherits lock_ref and access time, so size accounting is unchanged and a lock held on
        ``child`` keeps covering the same tokens. Its block hashes are shared out by where each block ends (no
        event: the tree holds the same blocks).
        """
        parent = child.parent
        assert parent is not None  # the root is never split
        upper = TreeNode(
            child.key[:pos],
            child.value[:pos],
            parent,
            next(self._ids),
            last_access_time=child.last_access_time,
            lock_ref=child.lock_ref,
            depth=parent.depth + pos,
        )
        if self.events is not None:
            bt = self.events.block_tokens
            k = upper.depth // bt - parent.depth // bt  # blocks ending inside the upper part
            upper.blocks, child.blocks = child.blocks[:k], child.blocks[k:]
            upper.chain_tail = as_digest(upper.blocks[-1]) if upper.blocks else parent.chain_tail
        parent.children[child.key[0]] = upper
        child.key = child.key[pos:]
        child.value = child.value[pos:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper


def _as_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    return token_ids if isinstance(token_ids, list) else list(token_ids)
