"""Shared-prefix workloads against our engine with the radix cache on and off, side by side in one process.

Prints one JSON line per workload, e.g. ``{"workload": "chat", "on": {...}, "off": {...}, "speedup": off/on}`` with
``"on"`` and ``"off"`` each ``{"wall_s", "output_tok_s", "mean_ttft_s", "cached_frac"}``.

(a) chat: 32 requests sharing one ~800-token system prompt, ~30-token distinct user turns, 64 output tokens,
    8 concurrent. (b) few-shot: 64 requests sharing a ~1,500-token few-shot prefix, distinct ~20-token questions,
    8 output tokens, 16 concurrent. Outputs have a fixed length (ignore_eos) so both modes do the same decode work.

The engine runs in-process (``Engine.generate``, the same path the HTTP server uses); TTFT is arrival to first token.
Usage: ``.venv/bin/python bench/shared_prefix.py [--workloads chat,fewshot] [--dtype auto]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from radixserve.engine.config import EngineArgs  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.engine.io_struct import GenerateRequest, SamplingParams  # noqa: E402

TOPICS = [
    "orbital mechanics",
    "sourdough baking",
    "medieval trade routes",
    "graph theory",
    "tide pools",
    "jazz harmony",
    "glacier formation",
    "compiler design",
    "beekeeping",
    "volcanic soils",
    "origami",
    "wind turbines",
    "coral reefs",
    "chess openings",
    "typography",
    "cloud physics",
]


def _words(rng: random.Random, n: int) -> str:
    vocab = (
        "policy customer account refund shipping order product warranty support escalate verify identity "
        "respond politely concise accurate never promise always confirm details summary steps troubleshoot "
        "device network reset password billing invoice schedule appointment language tone empathy"
    ).split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def _trim_to_tokens(tok, text: str, n: int) -> str:
    ids = tok.encode(text, add_special_tokens=False)[:n]
    return tok.decode(ids)


def chat_workload(tok, rng: random.Random) -> tuple[list[list[int]], int, int]:
    system = _trim_to_tokens(tok, "You are the support assistant of ACME Corp. Rules: " + _words(rng, 1200), 800)
    prompts = []
    for i in range(32):
        user = f"Question {i} about {TOPICS[i % len(TOPICS)]}: " + _words(rng, 22)
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts, 64, 8


def fewshot_workload(tok, rng: random.Random) -> tuple[list[list[int]], int, int]:
    shots = []
    for i in range(60):
        shots.append(
            f"Q: What is {rng.randint(10, 99)} plus {rng.randint(10, 99)} in {TOPICS[i % 16]}?\nA: {_words(rng, 8)}\n"
        )
    prefix = _trim_to_tokens(tok, "Answer like the examples.\n" + "".join(shots), 1500)
    prompts = []
    for i in range(64):
        q = f"\nQ: Explain item {i} of {TOPICS[i % len(TOPICS)]} " + _words(rng, 12) + "\nA:"
        prompts.append(tok.encode(prefix + q, add_special_tokens=False))
    return prompts, 8, 16


async def run_workload(engine: Engine, prompts: list[list[int]], max_new: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    ttfts, out_tokens, prompt_tokens, cached = [], 0, 0, 0

    async def one(ids: list[int]) -> None:
        nonlocal out_tokens, prompt_tokens, cached
        async with sem:
            t0 = time.monotonic()
            first = None
            req = GenerateRequest(
                uuid.uuid4().hex,
                ids,
                SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True),
                arrival_time=t0,
            )
            async for out in engine.generate(req):
                if first is None and out.token_ids:
                    first = time.monotonic() - t0
                if out.finished:
                    out_tokens += out.completion_tokens
                    prompt_tokens += out.prompt_tokens
                    cached += out.cached_tokens
            ttfts.append(first or 0.0)

    t0 = time.monotonic()
    await asyncio.gather(*[one(p) for p in prompts])
    wall = time.monotonic() - t0
    return {
        "wall_s": round(wall, 2),
        "output_tok_s": round(out_tokens / wall, 1),
        "mean_ttft_s": round(statistics.mean(ttfts), 3),
        "cached_frac": round(cached / max(prompt_tokens, 1), 3),
    }


def measure(args: argparse.Namespace, disable: bool, prompts, max_new: int, conc: int) -> dict:
    engine = Engine(
        EngineArgs(
            model_path=args.model_path,
            dtype=args.dtype,
            num_threads=args.threads,
            disable_radix_cache=disable,
            max_total_tokens=args.max_total_tokens,
            context_length=4096,
            max_running_requests=64,
            schedule_policy=args.policy,
        )
    )
    engine.start()
    try:
        return asyncio.run(run_workload(engine, prompts, max_new, conc))
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--workloads", default="chat,fewshot")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--policy", default="lpm")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--max-total-tokens", type=int, default=65536)
    args = p.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_path)
    builders = {"chat": chat_workload, "fewshot": fewshot_workload}
    for name in args.workloads.split(","):
        prompts, max_new, conc = builders[name](tok, random.Random(0))
        on = measure(args, False, prompts, max_new, conc)
        off = measure(args, True, prompts, max_new, conc)
        mean_prompt = round(statistics.mean(len(x) for x in prompts))
        print(
            json.dumps(
                {
                    "workload": name,
                    "requests": len(prompts),
                    "mean_prompt_tokens": mean_prompt,
                    "output_tokens": max_new,
                    "concurrency": conc,
                    "on": on,
                    "off": off,
                    "speedup": round(off["wall_s"] / on["wall_s"], 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
