"""The periodic "Decode batch." stats line (SGLang's ``log_decode_stats``): its format, its interval, the throughput
window, and the scheduler loop calling it. Regression (issue 11, item 10): an engine printed no periodic stats line.
No model: a stub runner whose logits always pick one token."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from radixserve.engine.io_struct import GenerateRequest, SamplingParams
from radixserve.engine.scheduler.scheduler import Scheduler, SchedulerConfig
from radixserve.engine.scheduler.stats import DecodeSnapshot, DecodeStatsLog, format_decode_line

from fake_engine import load_tokenizer

LINE = re.compile(
    r"^Decode batch\. #running-req: (\d+), #token: (\d+), token usage: (\d\.\d\d), cache hit rate: (\d+\.\d)%, "
    r"gen throughput \(token/s\): (\d+\.\d), #queue-req: (\d+)$"
)


def test_format_is_sglangs_line():
    snap = DecodeSnapshot(running_reqs=3, queued_reqs=0, used_tokens=1234, max_total_tokens=123400)
    assert format_decode_line(snap, 0.42, 45.61) == (
        "Decode batch. #running-req: 3, #token: 1234, token usage: 0.01, cache hit rate: 42.0%, "
        "gen throughput (token/s): 45.6, #queue-req: 0"
    )


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_every_interval_decode_steps_with_throughput_since_the_last_line():
    clock, lines = Clock(), []
    stats = DecodeStatsLog(4, clock=clock, log=lines.append)
    snap = DecodeSnapshot(2, 1, 50, 1000)
    stats.record_prompt(prompt_tokens=100)
    stats.record_prompt(cached_tokens=25)
    for step in range(1, 9):
        started = clock.t
        clock.t += 0.5  # each step: 0.5 s, 2 tokens
        out = stats.on_decode_step(2, started, lambda: snap)
        assert (out is not None) == (step % 4 == 0)
    assert len(lines) == 2
    m = LINE.match(lines[0])
    assert m and m.groups() == ("2", "50", "0.05", "25.0", "4.0", "1")  # 8 tokens in 2 s; 25 of 100 cached


def test_idle_time_does_not_count_against_throughput_and_an_idle_engine_logs_nothing():
    clock, lines = Clock(), []
    stats = DecodeStatsLog(2, clock=clock, log=lines.append)
    snap = DecodeSnapshot(1, 0, 10, 100)
    started = clock.t
    clock.t += 1.0
    stats.on_decode_step(1, started, lambda: snap)
    stats.on_idle()  # the request finished; an hour passes with nothing to do ...
    clock.t += 3600
    started = clock.t  # ... then a new request decodes
    clock.t += 1.0
    stats.on_decode_step(1, started, lambda: snap)
    assert len(lines) == 1
    assert LINE.match(lines[0]).group(5) == "1.0"  # 1 token in 1 s, not 2 tokens in 3602 s
    with pytest.raises(ValueError, match="at least 1"):
        DecodeStatsLog(0)


def stub_scheduler(tok, interval: int) -> tuple[Scheduler, list]:
    vocab = len(tok)
    token = tok.encode("a", add_special_tokens=False)[0]

    def forward(fb):
        logits = torch.zeros(len(fb.seq_lens_cpu), vocab)
        logits[:, token] = 1.0  # greedy always picks one plain token
        return logits

    runner = SimpleNamespace(device=torch.device("cpu"), max_total_tokens=512, forward=forward)
    outputs: list = []
    config = SchedulerConfig(context_length=256, decode_log_interval=interval)
    return Scheduler(runner, tok, config, [2], outputs.extend), outputs


def test_the_scheduler_loop_logs_the_line_while_decoding_only(caplog):
    tok = load_tokenizer()
    sched, outputs = stub_scheduler(tok, interval=4)
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    params = dict(max_new_tokens=9, temperature=0.0, ignore_eos=True)

    def run(*rids: str) -> None:
        for rid in rids:
            sched.submit(GenerateRequest(rid, list(prompt), SamplingParams(**params)))
        with torch.inference_mode():
            for _ in range(30):  # enough steps to finish, then idle ones
                sched._recv(block=False)
                sched.step()

    with caplog.at_level(logging.INFO, logger="radixserve.engine.scheduler.stats"):
        run("a", "b")  # one prefill step (token 1), then 8 decode steps of 2 requests: lines after steps 4 and 8
        first = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch.")]
        run("c")  # the same prompt again: a radix-cache hit
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch.")]
    assert len(first) == 2, first  # and none during the idle steps that followed
    assert all(LINE.match(line) for line in lines)
    m = LINE.match(first[0])
    assert m.group(1) == "2" and m.group(6) == "0" and int(m.group(2)) > 0
    assert LINE.match(first[0]).group(4) == "0.0"  # nothing cached yet
    assert len(lines) == 4  # request c: 8 more decode steps
    assert float(LINE.match(lines[-1]).group(4)) > 0  # c's prompt came from the cache
    assert sum(1 for o in outputs if o.finished) == 3
