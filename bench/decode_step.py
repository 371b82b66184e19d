"""Where a decode step's time goes, on the real model, against the time to read the weights once.

Per decode batch (``--batches``, default 1 and 8): that many requests of context ``--ctx`` (900) sharing their first
``--shared`` (800) tokens (one system prompt, a radix-cache hit) run through the engine's own ``Scheduler`` (in this
thread, no HTTP); after a few warm-up steps ``--steps`` decode steps are timed by the scheduler's per-step split
(``scheduler/timing.py``): forward, sampling (grammar mask included), scheduling (batch building, admission, KV
bookkeeping), output (tokens -> text, stop checks, ``ReqOutput``s). Next to it: the time to read the weights once
(``runner.weight_bytes()``) at the memory bandwidth measured in the same run (a ``sum`` over a 512 MiB tensor,
best of 5; a copy is printed too), and the ratio step / weight-read (issue 12's target: <= 2 at batch 8).

``--attention-variants`` adds the older comparison of the torch attention backend's decode variants (batch
``--batch``): ``legacy`` (gathered-then-permuted K/V copies), ``plain`` (head-major gather, no cascade) and
``cascade`` (the default), run interleaved, round-robin; ``--attention-profile`` prints a torch profiler table of the
cascade variant. ``--profile`` prints a cProfile of the timed decode steps of the largest batch (Python hot spots).

Usage: ``.venv/bin/python bench/decode_step.py [--dtype auto] [--batches 1,8] [--steps 32] [--threads 2]
[--torch-compile auto|on|off] [--weight-prepack auto|on|off]``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from radixserve.engine.attention.torch_cpu import TorchBackend  # noqa: E402
from radixserve.engine.engine import load_tokenizer  # noqa: E402
from radixserve.engine.io_struct import GenerateRequest, ReqOutput, SamplingParams  # noqa: E402
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixserve.engine.model.runner import ModelRunner  # noqa: E402
from radixserve.engine.scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402

WARMUP_STEPS = 4
BANDWIDTH_BYTES = 512 << 20


def memory_bandwidth(nbytes: int = BANDWIDTH_BYTES, reps: int = 5) -> tuple[float, float]:
    """(read, copy) bandwidth in bytes/s: ``sum`` over an fp32 tensor of ``nbytes`` (reads it once) and
    ``copy_`` into another (reads and writes it: 2 x nbytes), best of ``reps``, on torch's current threads."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    y.copy_(x)  # touch both (first-touch page faults are not bandwidth)
    read, copy = [], []
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        read.append(time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(x)
        copy.append(time.perf_counter() - t)
    return nbytes / min(read), 2 * nbytes / min(copy)


def prompts(tok: Any, batch: int, ctx: int, shared: int) -> list[list[int]]:
    """``batch`` prompts of ``ctx`` tokens whose first ``shared`` tokens are the same."""
    rules = " ".join(f"Rule {i}: answer briefly and politely." for i in range(400))
    system = tok.encode(rules, add_special_tokens=False)
    out = []
    for b in range(batch):
        own = tok.encode(" ".join(f"user{b} asks question {j}" for j in range(ctx)), add_special_tokens=False)
        out.append(system[:shared] + own[: ctx - shared])
    assert all(len(p) == ctx for p in out), "prompt text too short for --ctx"
    return out


def decode_split(runner: ModelRunner, tok: Any, batch: int, a: argparse.Namespace) -> dict[str, Any]:
    """Run ``batch`` requests to steady decode; the split of ``a.steps`` decode steps, ms per step."""
    outputs: list[ReqOutput] = []
    cfg = SchedulerConfig(
        max_running_requests=max(batch, 8),
        max_prefill_tokens=16384,
        chunked_prefill_size=16384,
        context_length=a.ctx + a.steps + 4 * WARMUP_STEPS,
    )
    sched = Scheduler(runner, tok, cfg, [tok.eos_token_id], outputs.extend)
    params = SamplingParams(max_new_tokens=a.steps + 3 * WARMUP_STEPS, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(tok, batch, a.ctx, a.shared)):
        sched.submit(GenerateRequest(f"b{batch}-{i}", p, params))
    prof = cProfile.Profile()
    with torch.inference_mode():
        sched._recv(block=False)
        while len(sched.running) < batch:  # prefill (the shared prefix once, then hits)
            sched.step()
        for _ in range(WARMUP_STEPS):
            sched.step()
        sched.step_timing.clear()
        t0 = time.perf_counter()
        if a.profile and batch == max(a.batch_list):
            prof.enable()
        for _ in range(a.steps):
            sched.step()
        prof.disable()
        wall = time.perf_counter() - t0
        for i in range(batch):
            sched.abort(f"b{batch}-{i}")
        sched._process_aborts()
    split = sched.step_timing.decode[batch]
    assert split.steps == a.steps, f"{split.steps} decode steps of batch {batch}, expected {a.steps}"
    ms = {k: round(v, 2) for k, v in split.per_step_ms().items()}
    if a.profile and batch == max(a.batch_list):
        print(f"cProfile of {a.steps} decode steps, batch {batch} (tottime):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return {"batch": batch, "steps": a.steps, "wall_ms": round(1e3 * wall / a.steps, 2), **ms}


class LegacyBackend(TorchBackend):
    """The previous decode attention: ``[B*L, Hkv, D]`` gather, then matmuls on permuted (copied) K/V."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        super().init_forward_metadata(batch)
        if batch.mode == ForwardMode.DECODE:
            L = max(batch.seq_lens_cpu)
            assert all(n == L for n in batch.seq_lens_cpu)
            self._legacy = (batch.kv_indices, L)

    def _decode_forward(self, q, k_buf, v_buf):
        gather, L = self._legacy
        B, Hkv, D, G, dt = q.shape[0], self.num_kv_heads, self.head_dim, self.group, q.dtype
        keys = k_buf.index_select(0, gather).view(B, L, Hkv, D).to(dt)
        vals = v_buf.index_select(0, gather).view(B, L, Hkv, D).to(dt)
        qg = (q * self.scale).view(B, Hkv, G, D)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float()
        probs = torch.softmax(scores, dim=-1).to(dt)
        return torch.matmul(probs, vals.transpose(1, 2)).reshape(B, Hkv * G * D)


def synthetic_decode_batch(B: int, L: int, shared: int) -> ForwardBatch:
    """B sequences of context L; the first ``shared`` slots are common to all, the rest distinct."""
    common = list(range(1, shared + 1))
    nxt = shared + 1
    slots = []
    for _ in range(B):
        own = list(range(nxt, nxt + L - shared))
        nxt += L - shared
        slots.append(common + own)
    return ForwardBatch.build(ForwardMode.DECODE, [[5]] * B, slots)


def attention_variants(r: ModelRunner, a: argparse.Namespace) -> None:
    be = r.attn_backend
    cfg = (be.num_heads, be.num_kv_heads, be.head_dim, be.scale)
    variants = {
        "legacy": LegacyBackend(*cfg),
        "plain": TorchBackend(*cfg, cascade_min_seqs=1 << 30),
        "cascade": TorchBackend(*cfg),
    }
    layouts = {
        "no shared prefix": synthetic_decode_batch(a.batch, a.ctx, 0),
        f"shared prefix {a.shared}": synthetic_decode_batch(a.batch, a.ctx, a.shared),
    }
    times: dict[tuple[str, str], list[float]] = {(lay, v): [] for lay in layouts for v in variants}
    original = r.attn_backend
    with torch.inference_mode():
        for rep in range(a.reps + 1):
            for lay, fb in layouts.items():
                for name, variant in variants.items():
                    r.attn_backend = variant
                    t = time.perf_counter()
                    r.forward(fb)
                    if rep:  # rep 0 warms up
                        times[(lay, name)].append((time.perf_counter() - t) * 1000)
        print(f"attention variants: decode step, batch {a.batch}, context {a.ctx}; ms (min / median)")
        for lay in layouts:
            row = "  ".join(
                f"{v}: {min(times[(lay, v)]):7.1f} / {statistics.median(times[(lay, v)]):7.1f}" for v in variants
            )
            print(f"  {lay:22s} {row}")
        if a.attention_profile:
            r.attn_backend = variants["cascade"]
            fb = layouts[f"shared prefix {a.shared}"]
            with torch.profiler.profile() as p:
                for _ in range(3):
                    r.forward(fb)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    r.attn_backend = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on CPUs with avx512_bf16, else float32")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes of the split, comma-separated")
    ap.add_argument("--ctx", type=int, default=900)
    ap.add_argument("--shared", type=int, default=800)
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--torch-compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="compiled forward: auto is the engine's default (on for CPU unless $RADIXSERVE_TORCH_COMPILE=0)",
    )
    ap.add_argument(
        "--weight-prepack", choices=["auto", "on", "off"], default="auto", help="auto: as the engine (bf16/fp16 packed)"
    )
    ap.add_argument("--profile", action="store_true", help="cProfile of the largest batch's timed steps")
    ap.add_argument("--attention-variants", action="store_true", help="also compare the attention decode variants")
    ap.add_argument("--attention-profile", action="store_true", help="torch profiler table of the cascade variant")
    ap.add_argument("--batch", type=int, default=8, help="batch of the attention-variant comparison")
    ap.add_argument("--reps", type=int, default=7, help="repetitions of the attention-variant comparison")
    a = ap.parse_args()
    a.batch_list = [int(b) for b in a.batches.split(",")]
    torch.set_num_threads(a.threads)
    pool = max(a.batch_list) * (a.ctx + a.steps + 4 * WARMUP_STEPS) + 64
    compile_choice = {"auto": None, "on": True, "off": False}[a.torch_compile]
    runner = ModelRunner(
        a.model,
        dtype=a.dtype,
        max_total_tokens=pool,
        num_threads=a.threads,
        context_length=2048,
        torch_compile=compile_choice,
        weight_prepack={"auto": None, "on": True, "off": False}[a.weight_prepack],
    )
    runner.warmup()  # compiles every graph when compiled, so no timed step waits for a compile
    tok = load_tokenizer(a.model)
    dtype = str(runner.dtype).removeprefix("torch.")
    rows = [decode_split(runner, tok, batch, a) for batch in a.batch_list]
    # Bandwidth right after the decode steps, under the same load (the better of two rounds).
    read_bw, copy_bw = map(max, zip(memory_bandwidth(), memory_bandwidth()))
    weight_bytes = runner.weight_bytes()
    if runner.model.lm_head_pack is not None:  # the tied LM head's packed copy is read per step, the embedding is not
        embed = runner.model.model.embed_tokens.weight
        weight_bytes -= embed.numel() * embed.element_size()
    weight_read_ms = 1e3 * weight_bytes / read_bw
    print(
        f"decode step split: context {a.ctx} ({a.shared} shared), {dtype}, {a.threads} threads, "
        f"{'compiled' if runner.compiled is not None else 'eager'}, "
        f"{'prepacked' if runner.prepacked else 'dense'} weights, {a.steps} steps; ms per step"
    )
    print(
        f"memory bandwidth: read {read_bw / 1e9:.1f} GB/s, copy {copy_bw / 1e9:.1f} GB/s; weights "
        f"{weight_bytes / 1e6:.0f} MB -> one read {weight_read_ms:.1f} ms"
    )
    print("  batch   forward    sample  schedule    output     total   step/weight-read")
    for row in rows:
        row["step_over_weight_read"] = round(row["total"] / weight_read_ms, 2)
        print(
            f"  {row['batch']:5d} {row['forward']:9.2f} {row['sample']:9.2f} {row['schedule']:9.2f} "
            f"{row['output']:9.2f} {row['total']:9.2f}   {row['step_over_weight_read']:.2f}"
        )
    summary = {
        "dtype": dtype,
        "threads": a.threads,
        "compiled": runner.compiled is not None,
        "prepacked": runner.prepacked,
        "ctx": a.ctx,
        "shared": a.shared,
        "read_gb_s": round(read_bw / 1e9, 2),
        "copy_gb_s": round(copy_bw / 1e9, 2),
        "weight_mb": round(weight_bytes / 1e6, 1),
        "weight_read_ms": round(weight_read_ms, 2),
        "decode": rows,
    }
    print(json.dumps(summary))
    if a.attention_variants or a.attention_profile:
        attention_variants(runner, a)


if __name__ == "__main__":
    main()
