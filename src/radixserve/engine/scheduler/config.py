"""The scheduler's budgets and switches (set from the engine flags, engine/config.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    """Scheduler budgets, in tokens / requests.

    Attributes:
        max_running_requests: samples decoding at once (``--max-running-requests``).
        max_prefill_tokens: new tokens per prefill batch (``--max-prefill-tokens``).
        chunked_prefill_size: new tokens per request per prefill batch (``--chunked-prefill-size``).
        schedule_policy: waiting-queue order, ``lpm`` or ``fcfs`` (policy.py).
        disable_radix_cache: no prefix cache (``NoPrefixCache``).
        context_length: longest sequence, prompt + output tokens.
        stream_interval: generated tokens between streamed deltas.
        decode_log_interval: decode steps between "Decode batch." lines (stats.py).
    """

    max_running_requests: int = 64
    max_prefill_tokens: int = 4096
    chunked_prefill_size: int = 1024
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    context_length: int = 8192
    stream_interval: int = 1
    decode_log_interval: int = 40
