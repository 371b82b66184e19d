"""The radix cache as a stream of block events, in the router's block-hash scheme (``contracts/block_hash.py``).

``RadixCache`` (``radix_cache.py``) publishes here, on the scheduler thread, every full block of ``block_tokens``
tokens it starts or stops holding: ``BlockStored`` when ``insert`` covers new full blocks, ``BlockRemoved`` when
``evict`` drops a node, ``AllCleared`` on ``reset`` (``/flush_cache``). A block is named by the chained hash of the
prefix that ends with it, in the namespace ``("tokens", served model name, None)``: the engine ignores
``cache_salt``, so what it publishes matches the router's keys of unsalted requests only. The HTTP handlers read
(``since``, ``snapshot``) on the event loop; one lock keeps the ring, ``seq`` and the live set in step.

A reader follows the cache exactly: take a ``snapshot`` (incarnation, seq, live blocks), then poll ``since(seq)``
and apply the events in order; a gap (events dropped from the ring, a seq from the future, or another incarnation:
the engine restarted) means "take a snapshot again".
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

DEFAULT_CAPACITY = 4096  # events kept for readers that poll with since()

EventType = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True)
class BlockStored:
    """The cache now holds these full blocks (wire hashes, unsigned 64-bit), parents before children."""

    seq: int
    hashes: tuple[int, ...]
    type: EventType = "stored"


@dataclass(frozen=True)
class BlockRemoved:
    """The cache no longer holds these full blocks (wire hashes)."""

    seq: int
    hashes: tuple[int, ...]
    type: EventType = "removed"


@dataclass(frozen=True)
class AllCleared:
    """The cache was flushed: no block is held any more."""

    seq: int
    hashes: tuple[int, ...] = ()
    type: EventType = "cleared"


CacheEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True)
class EventsSince:
    """``CacheEventLog.since``'s answer: ``events`` after the asked seq (oldest first) and the latest ``seq``; with
    ``gap`` some were lost (dropped from the ring, or the seq is newer than any: another incarnation's) and
    ``events`` is empty: take a ``snapshot``."""

    incarnation: str
    seq: int
    gap: bool
    events: tuple[CacheEvent, ...]


@dataclass(frozen=True)
class CacheSnapshot:
    """The live blocks at ``seq``, sorted (wire hashes)."""

    incarnation: str
    seq: int
    blocks: tuple[int, ...]


class CacheEventLog:
    """Sequenced block events of one engine's radix cache, a bounded ring of them and the live block set.

    Args:
        model: the served model name (the namespace of the hashes).
        block_tokens: tokens per block (>= 1).
        capacity: events kept in the ring (>= 1); older ones are dropped, and a reader behind them gets a gap.
        incarnation: this log's id (default: 16 random hex digits, new at every engine start), so a reader can tell
            a restarted engine, whose seq starts again at 0, from the one it followed.

    ``seq`` is 0 before any event and goes up by one per event. Thread-safe: writes (the scheduler thread) and reads
    (HTTP handlers) take one lock; each write costs O(blocks) plus one ring append.
    """

    def __init__(self, model: str, block_tokens: int, capacity: int = DEFAULT_CAPACITY, incarnation: str | None = None):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.model = model
        self.block_tokens = block_tokens
        self.capacity = capacity
        self.incarnation = incarnation or secrets.token_hex(8)
        self._lock = threading.Lock()
        self._ring: deque[CacheEvent] = deque(maxlen=capacity)
        self._seq = 0
        self._live: set[int] = set()

    # ------------------------------------------------------------------------------------------------ writes

    def stored(self, hashes: Iterable[int]) -> None:
        """Publish that the cache now holds ``hashes`` (no event when empty)."""
        hs = tuple(hashes)
        if not hs:
            return
        with self._lock:
            self._seq += 1
            self._ring.append(BlockStored(self._seq, hs))
            self._live.update(hs)

    def removed(self, hashes: Iterable[int]) -> None:
        """Publish that the cache no longer holds ``hashes`` (no event when empty)."""
        hs = tuple(hashes)
        if not hs:
            return
        with self._lock:
            self._seq += 1
            self._ring.append(BlockRemoved(self._seq, hs))
            self._live.difference_update(hs)

    def cleared(self) -> None:
        """Publish that the cache was flushed (always an event, so readers learn of it)."""
        with self._lock:
            self._seq += 1
            self._ring.append(AllCleared(self._seq))
            self._live.clear()

    # ------------------------------------------------------------------------------------------------ reads

    @property
    def seq(self) -> int:
        """The latest event's seq (0: none yet)."""
        with self._lock:
            return self._seq

    def since(self, seq: int) -> EventsSince:
        """The events with a seq above ``seq``, oldest first; a gap when one of them has left the ring or ``seq`` is
        above the latest (a reader of another incarnation). ``since(latest)`` is no events and no gap."""
        with self._lock:
            latest = self._seq
            if seq > latest or seq < 0:
                return EventsSince(self.incarnation, latest, True, ())
            if seq == latest:
                return EventsSince(self.incarnation, latest, False, ())
            oldest = self._ring[0].seq if self._ring else latest + 1
            if seq + 1 < oldest:
                return EventsSince(self.incarnation, latest, True, ())
            start = seq + 1 - oldest  # seqs in the ring are consecutive
            events = tuple(itertools.islice(self._ring, start, None))
            return EventsSince(self.incarnation, latest, False, events)

    def snapshot(self) -> CacheSnapshot:
        """The incarnation, the latest seq and the live blocks (sorted), read together."""
        with self._lock:
            live = list(self._live)
            seq = self._seq
        live.sort()  # outside the lock: the set is copied
        return CacheSnapshot(self.incarnation, seq, tuple(live))

    def live_count(self) -> int:
        """Blocks held now."""
        with self._lock:
            return len(self._live)
