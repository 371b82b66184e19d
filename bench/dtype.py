"""fp32 vs bf16 for our runner on this CPU: prefill tok/s and decode step time, interleaved in one process.

Prints one JSON line. The machine is shared, so variants alternate round by round and medians are reported;
compare the ratio, not the absolute numbers. Usage:
``python bench/dtype.py [--model models/smollm2-135m-instruct] [--threads 2] [--prefill 512] [--context 1024]
[--batch 8] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.model.runner import ModelRunner, cpu_has_avx512_bf16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measurement")
    p.add_argument("--context", type=int, default=1024, help="context length of each decoding sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per decode step")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    need = a.prefill + a.batch * (a.context + 1) + 1
    runners = {
        name: ModelRunner(a.model, dtype=name, device="cpu", attention_backend="torch", max_total_tokens=need)
        for name in ("float32", "bfloat16")
    }
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(runners.values())).model_config.vocab_size
    prompt = torch.randint(100, vocab, (a.prefill,), generator=g).tolist()
    prefill = ForwardBatch.build(ForwardMode.EXTEND, [prompt], [list(range(1, a.prefill + 1))])
    base = a.prefill + 1
    dec_slots = [list(range(base + i * (a.context + 1), base + (i + 1) * (a.context + 1))) for i in range(a.batch)]
    for r in runners.values():  # fill each decoding sequence's context once (values don't matter for timing)
        for s in dec_slots:
            ctx = torch.randint(100, vocab, (a.context,), generator=g).tolist()
            r.forward(ForwardBatch.build(ForwardMode.EXTEND, [ctx], [s[:-1]]))
    decode = ForwardBatch.build(ForwardMode.DECODE, [[5]] * a.batch, dec_slots)
    decode1 = ForwardBatch.build(ForwardMode.DECODE, [[5]], dec_slots[:1])
    res: dict[str, dict[str, list[float]]] = {n: {"prefill_s": [], "decode_s": [], "decode1_s": []} for n in runners}
    for _ in range(a.rounds):
        for name, r in runners.items():
            for key, batch in (("prefill_s", prefill), ("decode_s", decode), ("decode1_s", decode1)):
                t = time.perf_counter()
                r.forward(batch)
                res[name][key].append(time.perf_counter() - t)
    out = {
        "threads": a.threads,
        "avx512_bf16": cpu_has_avx512_bf16(),
        "prefill_tokens": a.prefill,
        "context": a.context,
        "batch": a.batch,
    }
    for name, m in res.items():
        pre, dec, dec1 = (statistics.median(m[k]) for k in ("prefill_s", "decode_s", "decode1_s"))
        out[name] = {
            "prefill_tok_s": round(a.prefill / pre, 1),
            f"decode_step_ms_batch{a.batch}": round(dec * 1e3, 1),
            "decode_step_ms_batch1": round(dec1 * 1e3, 1),
        }
    out["bf16_speedup_prefill"] = round(out["bfloat16"]["prefill_tok_s"] / out["float32"]["prefill_tok_s"], 2)
    out["bf16_speedup_decode"] = round(
        statistics.median(res["float32"]["decode_s"]) / statistics.median(res["bfloat16"]["decode_s"]), 2
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
