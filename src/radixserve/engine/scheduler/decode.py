"""The running decode set and retraction (preemption) when the KV pool runs out.

After mini-sglang's ``DecodeManager`` (python/minisgl/scheduler/decode.py) and SGLang's ``retract_decode``
(srt/managers/schedule_batch.py): every decode step needs one new slot per running sample; when free + evictable
slots are fewer, the newest samples (latest arrival, then highest sample index) give their KV back to the prefix
cache and wait at the head of the queue; their output so far is kept, so they resume where they stopped.
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.engine.scheduler.cache import KVCacheManager
from radixserve.engine.scheduler.request import Req


class DecodeManager:
    """The samples that decode one token per step, in admission order (the batch order of a decode step)."""

    def __init__(self) -> None:
        self.running: list[Req] = []

    @property
    def runnable(self) -> bool:
        return bool(self.running)

    def add(self, req: Req) -> None:
        """Start decoding ``req`` (its prefill is done)."""
        self.running.append(req)

    def remove(self, req: Req) -> None:
        """Stop decoding ``req`` (no-op if it is not running)."""
        if req in self.running:
            self.running.remove(req)

    def take(self, rids: set[str]) -> list[Req]:
        """Remove and return the running samples of ``rids``."""
        taken = [r for r in self.running if r.rid in rids]
        if taken:
            self.running = [r for r in self.running if r.rid not in rids]
        return taken

    def drop_finished(self) -> None:
        """Forget the samples that finished in the last step."""
        self.running = [r for r in self.running if not r.finished]

    def retract_until_fits(self, kv: KVCacheManager, retract: Callable[[Req], None]) -> list[Req]:
        """Retract the newest samples until one slot per remaining sample is free or evictable.

        ``retract(req)`` releases a victim's KV (it is already out of the running set); returns the victims."""
        victims: list[Req] = []
        while self.running and kv.available_size() < len(self.running):
            victim = max(self.running, key=lambda r: (r.arrival_time, r.index))
            self.running.remove(victim)
            retract(victim)
            victims.append(victim)
        return victims
