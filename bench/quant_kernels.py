"""CPU GEMM kernels for GGUF weights kept quantized, against the bfloat16 linear the engine runs today.

Per shape of SmolLM2-135M (``in -> out``: 576->1536 gate/up, 1536->576 down, 576->576 q/o, 576->960 fused qkv,
576->3072 fused gate_up, 576->49152 the tied LM head) and rows ``--rows`` (1 and 8: decode, 512: prefill), every
variant runs interleaved, round by round (the machine is shared), and the median microseconds per call are printed
in one table with the ratio to ``bf16-packed`` (oneDNN-prepacked bfloat16, ``engine/model/prepack.py``: the engine's
path today; < 1 is faster). Variants:

- ``bf16-packed`` / ``bf16-dense``: prepacked oneDNN / plain ``F.linear`` in bfloat16.
- ``q4-bf16``: ``aten._weight_int4pack_mm_for_cpu`` with bfloat16 activations and scale/zeros (``quant/int4_cpu.py``,
  Q4_0 and Q4_1 exactly, scales rounded to bfloat16 once).
- ``q4-fp32``: the same kernel with float32 activations and scales (x cast up and the output cast back included);
  only bfloat16 has a vectorized (AVX-512 / AVX2) kernel, float32 and float16 run a scalar loop: rows <= 8 only.
- ``q4-hybrid``: what ``Int4Linear`` runs (``int4_cpu.int4_linear``): the kernel up to ``DEQUANT_ROWS`` rows, above
  them the weight dequantized from the packed bytes (compiled by inductor: ``prepare_dequantize``) and ``F.linear``.
- ``q4-deq``: the dequantized path at every row count (``dequant_rows = 0``: where ``DEQUANT_ROWS`` should be);
  ``q4-deq-eager``: the same, the dequantization by the eager torch ops (``dequantize``
  unprepared: what runs where inductor cannot compile); ``q4-deq-ref``: the reference ``dequantize_codes`` (float32
  passes over plain codes, one byte a code: the path before the codes were read from the packed bytes) and
  ``F.linear``; ``deq-only``: the compiled dequantization alone. Rows > 8 only.
- ``q8-split``: Q8_0 as two int4 halves along K (``quant/affine.py``), bfloat16, the activation given twice.
- ``int8-chan``: ``aten._weight_int8pack_mm``, int8 with ONE scale per output row: not Q8_0's per-32 scales, so not
  exact for GGUF; listed as the int8 kernel's speed.
- ``dyn-q4``: ``aten._dyn_quant_matmul_4bit`` (group 32, float32; it quantizes the activations to int8 on the fly, and
  has no zero point: Q4_0 only, not exact); on x86 it is a scalar reference kernel, so it is run for rows <= 8 only.

On a machine shared with other load, ``--threads 1 --clock cpu`` measures the CPU time of each call, which being
descheduled does not inflate (memory-bandwidth contention still does).

Usage: ``.venv/bin/python bench/quant_kernels.py [--threads 2] [--rows 1,8,512] [--rounds 7] [--clock wall|cpu]
[--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import cpu_info  # noqa: E402
from radixserve.engine.model import prepack  # noqa: E402
from radixserve.engine.model.quant import int4_cpu  # noqa: E402
from radixserve.engine.model.quant.affine import Int4Affine  # noqa: E402
from radixserve.engine.model.quant.int4_cpu import int4_linear, int4_mm, pack  # noqa: E402

SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 960), (576, 3072), (576, 49152)]
BASELINE = "bf16-packed"
NAMES = (BASELINE, "bf16-dense", "q4-bf16", "q4-hybrid", "q4-deq", "q4-deq-eager", "q4-deq-ref", "deq-only")
NAMES += ("q8-split", "int8-chan", "q4-fp32", "dyn-q4")


class _Owner:
    """What a packed oneDNN weight's lifetime hangs on."""


def _variants(k: int, n: int, rows: int, gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    """Every variant's call for one ``[n, k]`` weight and ``rows`` activations (random values: speed only)."""
    groups = k // 32
    w = torch.randn(n, k, generator=gen) * 0.02
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x32 = x.float()
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d = (torch.rand(n, groups, generator=gen) * 0.01).half()
    q4 = Int4Affine.from_q4_1(codes, d, (-8 * d.float()).half())
    p_bf16, p_fp32 = pack(q4, torch.bfloat16), pack(q4, torch.float32)
    int4_cpu.prepare_dequantize(p_bf16.weight, p_bf16.scale_zeros, 1)  # as Int4Linear.load: compiled before timing
    q8 = pack(
        Int4Affine.from_q8_0(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), d), torch.bfloat16
    )
    owner = _Owner()
    handle = prepack.pack_linear(owner, w.bfloat16(), None)
    w_bf16 = w.bfloat16()
    w_i8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    s_i8 = (torch.rand(n, generator=gen) * 0.01).bfloat16()
    out: dict[str, Callable[[], torch.Tensor]] = {
        BASELINE: lambda: prepack.packed_linear(x, handle, n) if owner else x,
        "bf16-dense": lambda: F.linear(x, w_bf16),
        "q4-bf16": lambda: int4_mm(x, p_bf16.weight, p_bf16.scale_zeros, 1),
        "q4-hybrid": lambda: int4_linear(x, p_bf16.weight, p_bf16.scale_zeros, 1),
        "q8-split": lambda: int4_mm(x, q8.weight, q8.scale_zeros, 2),
        "int8-chan": lambda: torch.ops.aten._weight_int8pack_mm(x, w_i8, s_i8),
    }
    if rows > 8:
        layout = int4_cpu.pack_layout()
        assert layout is not None, "unknown int4 packing layout"
        out["q4-deq"] = lambda: int4_linear(x, p_bf16.weight, p_bf16.scale_zeros, 1, 0)
        out["q4-deq-eager"] = lambda: F.linear(
            x, int4_cpu._dequantize_t(p_bf16.weight, *int4_cpu._split(p_bf16.scale_zeros), 1, layout).T
        )
        out["q4-deq-ref"] = lambda: F.linear(x, int4_cpu.dequantize_codes(codes, p_bf16.scale_zeros, 1, x.dtype))
        out["deq-only"] = lambda: int4_cpu.dequantize(p_bf16.weight, p_bf16.scale_zeros, 1)
    if rows <= 8:  # both are scalar loops on x86: minutes per prefill-sized call
        out["q4-fp32"] = lambda: int4_mm(x32, p_fp32.weight, p_fp32.scale_zeros, 1).bfloat16()
        scales = (torch.rand(n, groups, generator=gen) * 0.01).float()
        nib = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        dyn = torch.ops.aten._dyn_quant_pack_4bit_weight(nib, scales, None, 32, k, n)
        out["dyn-q4"] = lambda: torch.ops.aten._dyn_quant_matmul_4bit(x32, dyn, 32, k, n)
    return out


def _time(fn: Callable[[], torch.Tensor], budget_s: float, clock: Callable[[], float]) -> float:
    """Median seconds per call (by ``clock``) over calls filling about ``budget_s`` of wall time (at least one)."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 1 or time.perf_counter() - start < budget_s:
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,8,512", help="activation rows per call, comma-separated")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds per (shape, rows); the median is kept")
    p.add_argument("--budget-s", type=float, default=0.05, help="seconds of calls per variant per round")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: perf_counter; cpu: this process's CPU time (with --threads 1, robust to other load on the machine)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    info = cpu_info()
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    gen = torch.Generator().manual_seed(0)
    if not a.json:
        print(f"CPU: {info['cpu_model']}, {info['cores']} cores usable, {a.threads} threads, torch {torch.__version__}")
        print("ISA: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in info["isa"].items()))
        print(f"flags: {info['flags']}")
        print(
            f"{a.clock} us per call (median of {a.rounds} interleaved rounds); (x) = time / {BASELINE}, < 1 is faster"
        )
        print(f"{'rows':>5} {'in->out':>11} " + " ".join(f"{name:>17}" for name in NAMES), flush=True)
    results: list[dict[str, object]] = []
    with torch.inference_mode():
        for rows in (int(r) for r in a.rows.split(",")):
            for k, n in SHAPES:
                variants = _variants(k, n, rows, gen)
                for fn in variants.values():  # warm-up (oneDNN primitive creation, page faults)
                    fn()
                samples: dict[str, list[float]] = {name: [] for name in variants}
                for _ in range(a.rounds):
                    for name, fn in variants.items():
                        samples[name].append(_time(fn, a.budget_s, clock))
                us = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
                results.append({"rows": rows, "in": k, "out": n, "us": us})
                if not a.json:
                    base = us[BASELINE]
                    cells = [f"{us[m]:9.1f} ({us[m] / base:4.2f})" if m in us else "-" for m in NAMES]
                    print(f"{rows:>5} {f'{k}->{n}':>11} " + " ".join(f"{c:>17}" for c in cells), flush=True)
    if a.json:
        print(json.dumps({"cpu": info["cpu_model"], "isa": info["isa"], "threads": a.threads, "results": results}))


if __name__ == "__main__":
    main()
