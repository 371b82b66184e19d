"""Hot-prefix replication: how many engines a prefix group may use, from its share of the demand.

A prefix group is every request with one ``PrefixKey.routing_key`` (the hash of its first K blocks: a shared system
prompt, a few-shot head). Consistent hashing sends a group to one owner, which is right while the group is a small
part of the traffic and wrong when it is most of it: one engine prefills and decodes everything while the others
idle (the hot-prefix pile-up reported against SGLang's, vLLM's and AIBrix's routers). The fix is not a fleet-wide
switch to load-only routing but a per-group replica set: the first ``r`` distinct workers clockwise from the key
(the owner, then the next ones in ring order), with ``r`` growing while the group's share of the demand exceeds
``r`` engines' fair share and shrinking when it cools. Preble (Srivatsa et al. 2024, "Preble: Efficient Distributed
Prompt Scheduling for LLM Serving") replicates hot prefixes the same way, from their load share.

Demand is the tokens a group's requests bring (prompt + max output), decayed exponentially with a half-life, so a
burst raises it at once and an idle group fades. The share is the group's decayed demand over all groups'. With ``n``
workers, the group wants ``ceil(share * n)`` replicas (its demand in units of one engine's fair share), at least 1,
at most ``n``; it grows to that at once and shrinks one replica at a time, only once ``share * n`` is below
``shrink_ratio`` of the smaller set (hysteresis: no flapping at the boundary). A group needs ``min_requests``
decayed requests (a second request within about a half-life) before it replicates, and grows only while every
replica it has is busy, so one lone request, or one user's requests one at a time, never cost a second prefill.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Demand:
    tokens: float = 0.0  # decayed tokens
    requests: float = 0.0  # decayed request count
    at: float = 0.0  # monotonic seconds of the last decay
    replicas: int = 1


class HotPrefixTracker:
    """Decayed demand per prefix group and its replica count.

    ``half_life_s``: seconds for a group's demand to halve when it gets no requests (0 disables replication: every
    group has one replica). ``shrink_ratio`` in (0, 1]: hysteresis of the shrink. ``min_requests``: decayed requests a
    group needs before it has more than one replica (1.5: a second request within about a half-life).
    ``max_groups``: groups tracked (least recently seen dropped). ``clock``: monotonic seconds (a seam for tests).
    Raises ``ValueError`` for a negative half-life, a ``shrink_ratio`` outside (0, 1] or ``max_groups < 1``.
    """

    def __init__(
        self,
        half_life_s: float = 10.0,
        shrink_ratio: float = 0.75,
        min_requests: float = 1.5,
        max_groups: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if half_life_s < 0:
            raise ValueError("half_life_s must be >= 0 (0 disables hot-prefix replication)")
        if not 0.0 < shrink_ratio <= 1.0:
            raise ValueError("shrink_ratio must be in (0, 1]")
        if max_groups < 1:
            raise ValueError("max_groups must be >= 1")
        self.half_life_s = half_life_s
        self.shrink_ratio = shrink_ratio
        self.min_requests = min_requests
        self.max_groups = max_groups
        self.clock = clock
        self._groups: OrderedDict[int, _Demand] = OrderedDict()
        self._total = _Demand()

    @property
    def enabled(self) -> bool:
        return self.half_life_s > 0

    def _decay(self, d: _Demand, now: float) -> None:
        if now > d.at:
            f = math.exp2(-(now - d.at) / self.half_life_s)
            d.tokens *= f
            d.requests *= f
        d.at = now

    def observe(self, group: int, tokens: int) -> None:
        """A request of ``group`` bringing ``tokens`` (prompt + max output tokens) is being routed."""
        if not self.enabled:
            return
        now = self.clock()
        d = self._groups.get(group)
        if d is None:
            d = self._groups[group] = _Demand(at=now)
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(group)
        for x in (d, self._total):
            self._decay(x, now)
            x.tokens += max(tokens, 1)
            x.requests += 1

    def share(self, group: int) -> float:
        """The group's fraction of all decayed demand now, in [0, 1] (0 for an unknown group)."""
        d = self._groups.get(group)
        if d is None or not self.enabled:
            return 0.0
        now = self.clock()
        self._decay(d, now)
        self._decay(self._total, now)
        return min(1.0, d.tokens / self._total.tokens) if self._total.tokens > 0 else 0.0

    def current(self, group: int) -> int:
        """The group's replica count as last decided (1 for an unknown group)."""
        d = self._groups.get(group)
        return d.replicas if d is not None else 1

    def replicas(self, group: int, n: int, busy: bool = True) -> int:
        """How many of ``n`` workers ``group`` may use now (1..n): grown at once to ``ceil(share * n)`` while its
        replicas are ``busy`` (each has a request in flight: a user sending one request at a time needs no second
        engine, however large its share), shrunk by one once ``share * n < shrink_ratio * (replicas - 1)``."""
        d = self._groups.get(group)
        if d is None or n <= 1 or not self.enabled:
            return 1
        demand = self.share(group) * n  # in engines' fair shares
        if d.requests < self.min_requests:
            d.replicas = 1
            return 1
        want = max(1, min(n, math.ceil(demand - 1e-9)))
        if want > d.replicas and busy:
            d.replicas = want
        elif d.replicas > 1 and demand < self.shrink_ratio * (d.replicas - 1):
            d.replicas -= 1
        d.replicas = min(d.replicas, n)
        return d.replicas

    def hot_groups(self) -> int:
        """Groups with more than one replica (for the metrics)."""
        return sum(1 for d in self._groups.values() if d.replicas > 1)
