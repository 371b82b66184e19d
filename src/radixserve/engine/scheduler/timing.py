"""Where a scheduler step's time goes: the per-step split (forward, sampling, scheduling, output) and the grammar
share of decode steps. Wall-clock seconds on the scheduler thread from ``time.perf_counter`` (a few calls per step).

Read by bench/decode_step.py (the split) and bench/constrained.py (grammar), through ``Scheduler.call``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GrammarTiming:
    """Time spent on grammar work (mask fill + apply + accept) vs whole decode steps, per decode batch shape.

    ``by_shape[(batch_size, constrained_rows)] = [steps, step_seconds, grammar_seconds]``; seconds of wall time on
    the scheduler thread. Read by bench/constrained.py; cheap enough to be always on (two perf_counter calls/step).
    """

    by_shape: dict[tuple[int, int], list[float]]

    def add(self, batch: int, constrained: int, step_s: float, grammar_s: float) -> None:
        rec = self.by_shape.setdefault((batch, constrained), [0, 0.0, 0.0])
        rec[0] += 1
        rec[1] += step_s
        rec[2] += grammar_s


@dataclass
class StepSplit:
    """Summed seconds of ``steps`` scheduler steps, by phase.

    Attributes:
        forward_s: ``ModelRunner.forward`` (the model, attention metadata included).
        sample_s: sampling, grammar mask fill / apply / accept included.
        schedule_s: admission or retraction, KV slot allocation, ``ForwardBatch`` building, KV release into the
            radix cache, stats and gauges.
        output_s: appending tokens, incremental detokenization, stop checks, building and emitting ``ReqOutput``s.
    """

    steps: int = 0
    forward_s: float = 0.0
    sample_s: float = 0.0
    schedule_s: float = 0.0
    output_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.forward_s + self.sample_s + self.schedule_s + self.output_s

    def per_step_ms(self) -> dict[str, float]:
        """Mean milliseconds per step of each phase and of the whole step (``total``)."""
        n = max(self.steps, 1)
        return {
            "forward": 1e3 * self.forward_s / n,
            "sample": 1e3 * self.sample_s / n,
            "schedule": 1e3 * self.schedule_s / n,
            "output": 1e3 * self.output_s / n,
            "total": 1e3 * self.total_s / n,
        }


@dataclass
class StepTiming:
    """The per-step split of decode steps by batch size (``decode[batch_size]``) and of all prefill steps."""

    decode: dict[int, StepSplit] = field(default_factory=dict)
    extend: StepSplit = field(default_factory=StepSplit)

    def add(
        self, decode_batch: int | None, forward_s: float, sample_s: float, schedule_s: float, output_s: float
    ) -> None:
        """Count one step: a decode step of ``decode_batch`` sequences, or a prefill step when it is None."""
        if decode_batch is None:
            rec = self.extend
        else:
            rec = self.decode.get(decode_batch) or self.decode.setdefault(decode_batch, StepSplit())
        rec.steps += 1
        rec.forward_s += forward_s
        rec.sample_s += sample_s
        rec.schedule_s += schedule_s
        rec.output_s += output_s

    def clear(self) -> None:
        self.decode.clear()
        self.extend = StepSplit()
