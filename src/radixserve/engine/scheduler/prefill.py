"""Admission of prefills: which waiting requests run in the next EXTEND batch, under the token budgets.

After SGLang's ``PrefillAdder`` (srt/managers/schedule_policy.py) and mini-sglang's ``PrefillManager``
(python/minisgl/scheduler/prefill.py). Per batch: at most ``max_prefill_tokens`` new tokens and
``max_running_requests`` running samples; each request's cached prefix is matched and locked first, so only the
rest is prefilled; a prompt longer than ``chunked_prefill_size`` (or than the budget left) is prefilled in chunks,
one chunked request at a time, which continues first in the next batch. A request is admitted only if its chunk plus
a decode reserve for every running request (``decode_reserve``) fits in the free + evictable slots; an empty engine
admits what fits without the reserve (nothing else could free memory).

Prompt logprobs (``input_logprobs.py``): a request scoring prompt tokens matches no further than its first scored
position (``Req.max_prefix_len``), and one that shares 32+ uncached tokens with a request already in the batch waits
a step to hit them in the cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from radixserve.engine.scheduler.cache import KVCacheManager
from radixserve.engine.scheduler.config import SchedulerConfig
from radixserve.engine.scheduler.policy import order_waiting
from radixserve.engine.scheduler.request import Req

# Fraction of a running request's remaining max_new_tokens reserved in the pool when admitting new prefills; the rest
# is covered by eviction and, if that is not enough, retraction (SGLang's new_token_ratio idea, fixed here).
DECODE_RESERVE_RATIO = 0.3
# A single request never reserves more than this many decode tokens at admission.
DECODE_RESERVE_CLIP = 256

# A request scoring prompt tokens that shares this many uncached tokens with a request already in the prefill batch
# waits for it (``PrefillManager._waits_for_batch_prefix``); SGLang's IN_BATCH_PREFIX_CACHING thresholds are 32 too.
IN_BATCH_PREFIX_MIN_TOKENS = 32

# on_admit(req, counts_cached, first_schedule): a request got its row; counts_cached when its cached prefix was
# measured for the first time (req.cached_tokens), first_schedule when it left the queue for the first time.
AdmitHook = Callable[[Req, bool, bool], None]


def decode_reserve(reqs: Iterable[Req], context_length: int) -> int:
    """KV slots held back for the decode tokens ``reqs`` will still generate, tokens: per sample
    ``DECODE_RESERVE_RATIO`` of its remaining ``max_new_tokens`` (at most ``DECODE_RESERVE_CLIP``)."""
    total = 0
    for r in reqs:
        remaining = r.max_new_tokens(context_length) - len(r.output_ids)
        total += int(min(max(remaining, 0), DECODE_RESERVE_CLIP) * DECODE_RESERVE_RATIO) * max(r.num_samples, 1)
    return total


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists (compared in blocks of 64, then token by token)."""
    n = min(len(a), len(b))
    i = 0
    while i + 64 <= n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefillManager:
    """The waiting queue and the chunked request; ``schedule`` picks the next prefill batch.

    Args:
        config: the budgets (``max_prefill_tokens``, ``chunked_prefill_size``, ``max_running_requests``,
            ``schedule_policy``, ``context_length``).
        kv: slots, rows and the prefix cache.
        on_admit: stats / metrics hook (``AdmitHook``), or None.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, on_admit: AdmitHook | None = None):
        self.config = config
        self.kv = kv
        self.on_admit = on_admit
        self.waiting: list[Req] = []
        self.chunked_req: Req | None = None  # admitted, part of its prompt still to prefill

    @property
    def runnable(self) -> bool:
        return bool(self.waiting) or self.chunked_req is not None

    def add(self, req: Req) -> None:
        """Queue a new request (arrival order; the policy reorders at admission)."""
        self.waiting.append(req)

    def requeue(self, req: Req) -> None:
        """Put a retracted request (its KV released) back at the head of the queue."""
        if self.chunked_req is req:
            self.chunked_req = None
        self.waiting.insert(0, req)

    def take(self, rids: set[str]) -> list[Req]:
        """Remove and return the waiting and chunked requests of ``rids`` (their KV still held: release it)."""
        taken = [r for r in self.waiting if r.rid in rids]
        if taken:
            self.waiting = [r for r in self.waiting if r.rid not in rids]
        if self.chunked_req is not None and self.chunked_req.rid in rids:
            taken.append(self.chunked_req)
            self.chunked_req = None
        return taken

    def schedule(self, running: Sequence[Req]) -> list[Req]:
        """The next prefill batch (possibly empty), each request with its row, locked prefix and ``extend_len`` set;
        ``running`` is the decode set (its reserve and count limit admission). Slots are not allocated yet."""
        cfg = self.config
        if not self.runnable:
            return []
        batch: list[Req] = []
        budget = cfg.max_prefill_tokens
        reserve = decode_reserve(running, cfg.context_length)
        num_running = len(running)

        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            self._set_extend(req, budget)
            budget -= req.extend_len
            batch.append(req)
            num_running += req.num_samples
            if req.kv_len + req.extend_len < req.seq_len:
                self.chunked_req = req  # still more chunks to go
                return batch

        for req in order_waiting(self.waiting, cfg.schedule_policy, self.kv.cache):
            if budget <= 0 or num_running + req.num_samples > cfg.max_running_requests:
                break
            fill = req.fill_ids
            # The last token is always computed (its logits pick the next one), and prompt tokens to score too.
            match = self.kv.match(fill[: req.max_prefix_len()])
            if self._waits_for_batch_prefix(req, match.prefix_len, batch):
                continue  # prefilled by a request of this batch: hit it in the cache next step
            need = len(fill) - match.prefix_len
            chunk = min(need, budget, cfg.chunked_prefill_size)
            if chunk < need and chunk < min(cfg.chunked_prefill_size, need) and batch:
                break  # not enough budget left for a useful chunk; leave it for the next batch
            # Lock the prefix before measuring free memory: a locked prefix is no longer evictable, and counting it
            # as free would re-admit a just-retracted request only to retract it again (livelock).
            self.kv.lock(match.last_node)
            reserve_req = decode_reserve([req], cfg.context_length)
            free = self.kv.available_size() - sum(r.extend_len for r in batch)  # minus admitted, unallocated
            if chunk + reserve + reserve_req > free and not (not batch and not running and chunk <= free):
                self.kv.unlock(match.last_node)
                break
            self.waiting.remove(req)
            if not self.kv.assign(req, match):
                self.kv.unlock(match.last_node)
                self.waiting.insert(0, req)
                break
            self._admitted(req)
            self._set_extend(req, budget)
            budget -= req.extend_len
            reserve += reserve_req
            num_running += req.num_samples
            batch.append(req)
            if req.kv_len + req.extend_len < req.seq_len:
                self.chunked_req = req
                break
        return batch

    def _waits_for_batch_prefix(self, req: Req, cached: int, batch: Sequence[Req]) -> bool:
        """True when ``req`` scores prompt tokens and shares at least ``IN_BATCH_PREFIX_MIN_TOKENS`` tokens past its
        ``cached`` prefix with a request of ``batch`` (the next prefill batch so far), within what ``req`` may take
        from the cache; never without a prefix cache.

        Such a request waits one step, then finds the shared tokens in the cache instead of prefilling them again
        (SGLang's in-batch prefix caching, schedule_policy.py). Applied to requests scoring prompt tokens, e.g.
        ``select``'s ``[prefix + choice_i]``, whose shared prefix is most of the work; other requests keep
        prefilling together (time to first token first)."""
        if not req.wants_input_logprobs or not self.kv.shares_prefixes:
            return False
        fill = req.fill_ids[: req.max_prefix_len()]
        if len(fill) - cached < IN_BATCH_PREFIX_MIN_TOKENS:
            return False
        return any(common_prefix_len(fill, other.fill_ids) - cached >= IN_BATCH_PREFIX_MIN_TOKENS for other in batch)

    def _admitted(self, req: Req) -> None:
        counts_cached = not req.cached_tokens_set
        if counts_cached:  # the first admission's prefix hit is what the client is told (not a retraction's)
            req.cached_tokens = min(req.prefix_len, len(req.origin_input_ids))
            req.cached_tokens_set = True
        first_schedule = req.first_scheduled_time is None
        if first_schedule:
            req.first_scheduled_time = time.monotonic()
        if self.on_admit is not None:
            self.on_admit(req, counts_cached, first_schedule)

    def _set_extend(self, req: Req, budget: int) -> None:
        need = req.seq_len - req.kv_len
        req.extend_len = max(1, min(need, max(budget, 1), self.config.chunked_prefill_size))
