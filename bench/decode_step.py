"""Decode-step time of the torch attention backend's variants, side by side in one process (real model).

Batch 8, context 900 (``--batch``/``--ctx``), two slot layouts: every sequence with its own slots ("no shared prefix"),
and all sequences sharing their first ``--shared`` slots (a radix-cache hit on one system prompt). Variants:
``legacy`` (the gathered-then-permuted decode attention this backend used before: permute copies of K/V for the
matmuls), ``plain`` (head-major gather, no copies, cascade disabled) and ``cascade`` (the default backend). Variants run
interleaved, round-robin, so load from other processes hits all of them alike; prints min and median ms per step.

Usage: ``.venv/bin/python bench/decode_step.py [--dtype bfloat16] [--reps 7] [--profile]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from radixserve.engine.attention.torch_cpu import TorchBackend  # noqa: E402
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixserve.engine.model.runner import ModelRunner  # noqa: E402


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


def decode_batch(B: int, L: int, shared: int) -> ForwardBatch:
    """B sequences of context L; the first ``shared`` slots are common to all, the rest distinct."""
    common = list(range(1, shared + 1))
    nxt = shared + 1
    slots = []
    for _ in range(B):
        own = list(range(nxt, nxt + L - shared))
        nxt += L - shared
        slots.append(common + own)
    return ForwardBatch.build(ForwardMode.DECODE, [[5]] * B, slots)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=900)
    ap.add_argument("--shared", type=int, default=800)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="torch profiler table of the cascade variant, shared")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    r = ModelRunner(a.model, dtype=a.dtype, max_total_tokens=a.batch * a.ctx + 16, num_threads=a.threads)
    cfg = (r.attn_backend.num_heads, r.attn_backend.num_kv_heads, r.attn_backend.head_dim, r.attn_backend.scale)
    variants = {
        "legacy": LegacyBackend(*cfg),
        "plain": TorchBackend(*cfg, cascade_min_seqs=1 << 30),
        "cascade": TorchBackend(*cfg),
    }
    layouts = {
        "no shared prefix": decode_batch(a.batch, a.ctx, 0),
        f"shared prefix {a.shared}": decode_batch(a.batch, a.ctx, a.shared),
    }
    times: dict[tuple[str, str], list[float]] = {(lay, v): [] for lay in layouts for v in variants}
    with torch.inference_mode():
        for rep in range(a.reps + 1):
            for lay, fb in layouts.items():
                for name, be in variants.items():
                    r.attn_backend = be
                    t = time.perf_counter()
                    r.forward(fb)
                    if rep:  # rep 0 warms up
                        times[(lay, name)].append((time.perf_counter() - t) * 1000)
        print(f"decode step, batch {a.batch}, context {a.ctx}, {a.dtype}, {a.threads} threads; ms (min / median)")
        for lay in layouts:
            row = "  ".join(
                f"{v}: {min(times[(lay, v)]):7.1f} / {statistics.median(times[(lay, v)]):7.1f}" for v in variants
            )
            print(f"  {lay:22s} {row}")
        if a.profile:
            r.attn_backend = variants["cascade"]
            fb = layouts[f"shared prefix {a.shared}"]
            with torch.profiler.profile() as p:
                for _ in range(3):
                    r.forward(fb)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
