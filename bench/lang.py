"""A radixserve.lang program vs the same calls as independent chat requests, side by side on one stack.

The program reads a ~1,000-token document, then runs 3 sequential gens (title, summary, topic: each turn sees the
turns before it) and a 5-way fork (five reader questions, concurrently). The baseline sends the same 8 calls as
independent ``/v1/chat/completions`` requests, each with the document and its own instruction but none of the other
calls' history (the 3 one after another, the 5 concurrently). Every call decodes the same number of tokens
(``ignore_eos``), greedily. Before each arm the engine's radix cache is flushed.

Per arm: wall time, requests, prompt tokens sent, tokens served from the radix cache, prefilled tokens (= prompt −
cached, from the engine's ``radixserve_engine_{prompt,cached}_tokens_total``), completion tokens; medians over
``--rounds`` (arms interleaved). Prints the CPU, one JSON line per arm and a table.

Usage: ``.venv/bin/python bench/lang.py`` (starts ``radixserve up`` with one engine on the demo model, eager), or
``--url ROUTER --engine-url ENGINE`` for a running stack.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import radixserve.lang as sgl  # noqa: E402
from _common import VOCAB, cpu_info, free_port, make_log  # noqa: E402

log = make_log("lang")
SYSTEM = "You are a careful analyst of documents."
SEQUENTIAL = [
    ("title", "Give the document a short title."),
    ("summary", "Summarize the document in one sentence."),
    ("topic", "Name the document's main topic in a few words."),
]
FORKS = 5


def fork_instruction(i: int) -> str:
    return f"Write question number {i + 1} that a reader might ask about the document."


def make_document(target_tokens: int, count_tokens: Callable[[str], int], seed: int = 0) -> str:
    """Sentences of ``VOCAB`` words until the text is about ``target_tokens`` tokens (measured by the server)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    text = ""
    while True:
        for _ in range(20):
            words = rng.choices(VOCAB, k=rng.randint(8, 16))
            sentences.append(" ".join(words).capitalize() + ".")
        text = " ".join(sentences)
        if count_tokens(text) >= target_tokens:
            return text


@sgl.function
def analyze(s: Any, document: str, max_tokens: int) -> None:
    s += sgl.system(SYSTEM)
    for i, (name, instruction) in enumerate(SEQUENTIAL):
        s += sgl.user((f"Document:\n{document}\n\n" if i == 0 else "") + instruction)
        s += sgl.assistant(sgl.gen(name, max_tokens=max_tokens, ignore_eos=True))
    forks = s.fork(FORKS)
    forks += lambda i: sgl.user(fork_instruction(i))
    forks += sgl.assistant(sgl.gen("question", max_tokens=max_tokens, ignore_eos=True))
    forks.join()


def chat_calls(client: httpx.Client, url: str, model: str, document: str, max_tokens: int) -> None:
    """The baseline: the same 8 calls, each an independent chat request (document + its instruction)."""

    def call(instruction: str) -> None:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Document:\n{document}\n\n{instruction}"},
        ]
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        r = client.post(url + "/v1/chat/completions", json=body)
        r.raise_for_status()

    for _, instruction in SEQUENTIAL:
        call(instruction)
    with ThreadPoolExecutor(FORKS) as pool:
        list(pool.map(call, [fork_instruction(i) for i in range(FORKS)]))


COUNTERS = ("prompt_tokens_total", "cached_tokens_total", "generation_tokens_total", "num_requests_total")


def counters(client: httpx.Client, engine: str) -> dict[str, float]:
    """The engine's token and request counters (summed over label sets)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in client.get(engine + "/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{")[0].removeprefix("radixserve_engine_")
        if name in out:
            out[name] += float(value.rsplit(" ", 1)[-1])
    return out


def run_arm(work: Callable[[], None], client: httpx.Client, engine: str) -> dict[str, float]:
    """Flush the cache, run ``work``, and measure it by the engine's counters."""
    r = client.post(engine + "/flush_cache", json={})
    r.raise_for_status()
    before = counters(client, engine)
    t0 = time.perf_counter()
    work()
    wall = time.perf_counter() - t0
    after = counters(client, engine)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    prompt, cached = delta("prompt_tokens_total"), delta("cached_tokens_total")
    return {
        "wall_s": round(wall, 3),
        "requests": delta("num_requests_total"),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens": prompt - cached,
        "completion_tokens": delta("generation_tokens_total"),
    }


def start_stack(log_path: str) -> tuple[subprocess.Popen[bytes], str, str]:
    """``radixserve up`` with one engine on the demo model (eager); (process, router URL, engine URL) once healthy."""
    port, engine_port = free_port(), free_port()
    model = os.path.join(ROOT, "models", "smollm2-135m-instruct")
    argv = [sys.executable, "-m", "radixserve", "up", "--model-path", model, "--engines", "1"]
    argv += ["--port", str(port), "--engine-base-port", str(engine_port)]
    argv += ["--disable-torch-compile", "--max-total-tokens", "32768", "--context-length", "4096"]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    router, engine = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{engine_port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"radixserve up exited {proc.returncode}; see {log_path}")
        try:
            if httpx.get(router + "/health", timeout=2).status_code == 200:
                return proc, router, engine
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"radixserve up did not become healthy; see {log_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running router (or engine); default: start radixserve up")
    parser.add_argument("--engine-url", help="the engine behind --url (metrics, /flush_cache); default: --url")
    parser.add_argument("--context-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens decoded per call")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    cpu = cpu_info()
    print(json.dumps({"cpu_model": cpu["cpu_model"], "cores": cpu["cores"], "isa": cpu["isa"]}), flush=True)
    proc = None
    if args.url:
        router, engine = args.url.rstrip("/"), (args.engine_url or args.url).rstrip("/")
    else:
        log_path = os.path.join(tempfile.mkdtemp(prefix="bench-lang-"), "up.log")
        log(f"starting radixserve up (log: {log_path})")
        proc, router, engine = start_stack(log_path)
    try:
        client = httpx.Client(timeout=600)
        model = client.get(router + "/v1/models").json()["data"][0]["id"]

        def count_tokens(text: str) -> int:
            body = {"text": text, "sampling_params": {"max_new_tokens": 0}}
            return int(client.post(engine + "/generate", json=body).json()["meta_info"]["prompt_tokens"])

        document = make_document(args.context_tokens, count_tokens)
        log(f"document: {count_tokens(document)} tokens; {args.rounds} rounds, {args.max_tokens} tokens per call")
        backend = sgl.RuntimeEndpoint(router)

        def program() -> None:
            state = analyze.run(document=document, max_tokens=args.max_tokens, backend=backend)
            if state.error() is not None:
                raise RuntimeError(state.error())

        arms: dict[str, Callable[[], None]] = {
            "lang_program": program,
            "independent_chat": lambda: chat_calls(client, router, model, document, args.max_tokens),
        }
        program()  # warm-up: the chat template, connections, first-request costs
        results: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
        for r in range(args.rounds):
            for name, work in arms.items():
                res = run_arm(work, client, engine)
                results[name].append(res)
                log(f"round {r + 1} {name}: {res}")
        table = []
        for name, runs in results.items():
            med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            line = {"arm": name, **med, "rounds": len(runs)}
            print(json.dumps(line), flush=True)
            table.append(line)
        header = f"{'arm':<18}{'wall s':>8}{'requests':>10}{'prompt':>9}{'cached':>9}{'prefill':>9}{'completion':>12}"
        print(header)
        for row in table:
            print(
                f"{row['arm']:<18}{row['wall_s']:>8.2f}{row['requests']:>10.0f}{row['prompt_tokens']:>9.0f}"
                f"{row['cached_tokens']:>9.0f}{row['prefill_tokens']:>9.0f}{row['completion_tokens']:>12.0f}"
            )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
