"""The periodic "Decode batch." stats line of an engine, as SGLang's scheduler logs it (``log_decode_stats``).

Every ``interval`` decode steps (``--decode-log-interval``, default 40) the scheduler logs at INFO::

    Decode batch. #running-req: 3, #token: 1234, token usage: 0.01, cache hit rate: 42.0%,
    gen throughput (token/s): 45.6, #queue-req: 0

(one line). ``#token`` is KV slots in use by requests and the radix tree minus the evictable ones, ``token usage``
that over the pool's capacity (as the ``token_usage`` gauge), ``cache hit rate`` the share of prompt tokens served
from the radix cache since the engine started (as SGLang's tree-cache hit rate; the counters of
``cached_tokens_total`` / ``prompt_tokens_total``), ``gen throughput`` the tokens decoded per wall-clock second since
the last line. Lines come only from decode steps, so an idle engine logs nothing; the throughput window restarts
when the engine goes idle, so an idle hour does not read as a slow minute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeSnapshot:
    """What the line reports about the engine right after a decode step (requests, KV slots in tokens)."""

    running_reqs: int
    queued_reqs: int
    used_tokens: int  # in use and not evictable
    max_total_tokens: int


@dataclass(frozen=True)
class LoadSnapshot:
    """The scheduler's load after its latest step (``GET /load``), published whole so any thread reads one step's
    numbers. Requests count samples; tokens are KV tokens.

    Attributes:
        queued_requests: samples waiting for prefill (the scheduler's queue; the engine adds what is not in it yet).
        queued_prefill_tokens: prompt (and, after a retraction, output) tokens of the waiting samples and of the
            chunked prefill that have no KV yet. A waiting sample's cached prefix is only matched at admission, so
            it counts in full: an upper bound of the prefill work ahead.
        running_requests: samples decoding, plus the one being chunk-prefilled.
        running_tokens: KV slots in use and not evictable (requests' own slots and the cache nodes they lock).
        max_total_tokens: the KV pool's size.
    """

    queued_requests: int = 0
    queued_prefill_tokens: int = 0
    running_requests: int = 0
    running_tokens: int = 0
    max_total_tokens: int = 0


def format_decode_line(snap: DecodeSnapshot, cache_hit_rate: float, gen_throughput: float) -> str:
    """The stats line; ``cache_hit_rate`` in [0, 1], ``gen_throughput`` in tokens per second."""
    usage = snap.used_tokens / max(snap.max_total_tokens, 1)
    return (
        f"Decode batch. #running-req: {snap.running_reqs}, #token: {snap.used_tokens}, token usage: {usage:.2f}, "
        f"cache hit rate: {100 * cache_hit_rate:.1f}%, gen throughput (token/s): {gen_throughput:.1f}, "
        f"#queue-req: {snap.queued_reqs}"
    )


class DecodeStatsLog:
    """Counts decode steps and tokens and logs ``format_decode_line`` every ``interval`` decode steps.

    The scheduler calls ``record_prompt`` when a request's prompt is counted and when its cached prefix is known,
    ``on_decode_step`` after every decode step, and ``on_idle`` when nothing is left to run. ``clock`` (seconds,
    monotonic) and ``log`` are seams for tests. Raises ValueError for ``interval < 1``.
    """

    def __init__(
        self,
        interval: int,
        clock: Callable[[], float] = time.perf_counter,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if interval < 1:
            raise ValueError(f"decode log interval must be at least 1, got {interval}")
        self.interval = interval
        self.clock = clock
        self.log = log if log is not None else logger.info
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.decode_steps = 0
        self._window_start: float | None = None  # when the throughput window began; None while idle
        self._window_tokens = 0

    def record_prompt(self, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        """Add prompt tokens received and prompt tokens served from the radix cache."""
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def cache_hit_rate(self) -> float:
        """Cached over received prompt tokens since the start, 0.0 before any prompt."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def on_decode_step(self, tokens: int, started_at: float, snapshot: Callable[[], DecodeSnapshot]) -> str | None:
        """Count one decode step that generated ``tokens`` and began at ``started_at`` (``clock`` seconds); every
        ``interval``-th step log the line (``snapshot`` is read only then) and return it, else return None."""
        if self._window_start is None:
            self._window_start = started_at
        self._window_tokens += tokens
        self.decode_steps += 1
        if self.decode_steps % self.interval:
            return None
        now = self.clock()
        elapsed = now - self._window_start
        throughput = self._window_tokens / elapsed if elapsed > 0 else 0.0
        line = format_decode_line(snapshot(), self.cache_hit_rate(), throughput)
        self.log(line)
        self._window_start, self._window_tokens = now, 0
        return line

    def on_idle(self) -> None:
        """Nothing runs any more: the next decode step starts a new throughput window."""
        self._window_start, self._window_tokens = None, 0
