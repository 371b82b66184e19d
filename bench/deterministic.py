"""What ``--enable-deterministic-inference`` costs: the same forwards with the flag off and on, side by side.

One ``ModelRunner`` on the real model (``--dtype``, default the CPU's ``auto``; weights prepacked as the engine does);
the flag is switched on the loaded runner (batch-invariant projections and LM head, ``model/batch_invariant.py``, and
the torch backend's deterministic attention) and off again, alternating, so both see the same machine state. For each
forward the median of ``--reps`` timed runs per side, in ms, and the ratio on / off. The KV slots the decodes read are
filled by real prefills first. Prints the CPU model and flags and one JSON line at the end.

Usage: ``.venv/bin/python bench/deterministic.py [--dtype auto] [--threads 2] [--reps 7]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


from _common import cpu_info  # noqa: E402
from radixserve.engine.attention.torch_cpu import TorchBackend  # noqa: E402
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixserve.engine.model.runner import ModelRunner  # noqa: E402

MODEL_DIR = os.path.join(ROOT, "models", "smollm2-135m-instruct")


def set_deterministic(runner: ModelRunner, on: bool) -> None:
    """What ``ModelRunner(deterministic=on)`` sets at start-up, on a loaded runner."""
    runner.model.set_batch_invariant(on)
    assert isinstance(runner.attn_backend, TorchBackend)
    runner.attn_backend.deterministic = on


def forwards(runner: ModelRunner) -> dict[str, ForwardBatch]:
    """The timed forwards, by name; prefills the contexts the decodes attend to."""
    rng = random.Random(0)
    vocab = runner.model_config.vocab_size
    free = iter(range(1, runner.max_total_tokens))

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    def slots(n: int) -> list[int]:
        return [next(free) for _ in range(n)]

    ctx512 = slots(512)
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [ids(512)], [ctx512]))
    shared = slots(800)
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [ids(800)], [shared]))
    own = [slots(30 + 8 * i) for i in range(8)]
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [ids(len(o)) for o in own], [shared + o for o in own]))
    step = slots(9)
    return {
        "decode, batch 1, context 512": ForwardBatch.build(ForwardMode.DECODE, [[5]], [ctx512 + step[:1]]),
        "decode, batch 8, 800 shared + 30-86 own": ForwardBatch.build(
            ForwardMode.DECODE, [[5 + i] for i in range(8)], [shared + o + [s] for o, s in zip(own, step[1:])]
        ),
        "extend, 512 new tokens": ForwardBatch.build(ForwardMode.EXTEND, [ids(512)], [slots(512)]),
        "extend, 4 x 40 new over 800 shared": ForwardBatch.build(
            ForwardMode.EXTEND, [ids(40) for _ in range(4)], [shared + slots(40) for _ in range(4)]
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL_DIR)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    cpu = cpu_info()
    print(f"CPU: {cpu['cpu_model']}, {cpu['cores']} cores, {cpu['isa']}")
    runner = ModelRunner(args.model, dtype=args.dtype, device="cpu", num_threads=args.threads, max_total_tokens=4096)
    print(f"dtype {runner.dtype}, {args.threads} threads, weights prepacked: {runner.prepacked}")
    results = {}
    for name, batch in forwards(runner).items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for rep in range(args.reps + 1):
            for on in (False, True):
                set_deterministic(runner, on)
                t = time.perf_counter()
                runner.forward(batch)
                if rep:  # the first round warms both sides up
                    times[on].append(time.perf_counter() - t)
        off, on_ = (statistics.median(times[k]) * 1e3 for k in (False, True))
        results[name] = {"off_ms": round(off, 1), "on_ms": round(on_, 1), "ratio": round(on_ / off, 2)}
        print(f"{name:42s} off {off:8.1f} ms   on {on_:8.1f} ms   {on_ / off:.2f}x", flush=True)
    set_deterministic(runner, False)
    print(
        json.dumps(
            {
                "cpu_model": cpu["cpu_model"],
                "dtype": str(runner.dtype),
                "threads": args.threads,
                "load_avg": os.getloadavg()[0],
                "forwards": results,
            }
        )
    )


if __name__ == "__main__":
    main()
