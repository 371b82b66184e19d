"""Router benchmark: routing policies on a multi-conversation workload, router overhead, and 1,000 concurrent streams.

Prints progress to stderr and one final JSON line to stdout:
``{"single_engine_hit_rate", "policies": {name: {"hit_rate", "output_tok_s", "mean_ttft_s", "wall_s",
"spills"}}, "router_overhead_p50_ms", "direct_p50_ms", "router_p50_ms", "streams": {"concurrent", "errors",
"wall_s"}}``

(1) Workload: ``--conversations`` chats (default 16) x ``--turns`` turns (default 4), each chat with its own
    ~``--system-tokens``-token system prompt, interleaved (every chat's turn t is sent, in shuffled order,
    ``--concurrency`` at a time, before any turn t+1), greedy, ``--max-tokens`` output tokens, streamed with usage.
    Hit rate = sum of the engines' ``cached_tokens`` / sum of prompt tokens. It runs once against one engine
    directly (the single-engine hit rate: every turn finds its conversation) and once per policy through the router
    in front of ``--engines`` real engines (``--threads-per-engine`` each; caches flushed before each run).
(2) Overhead: a canned upstream (bench/canned_upstream.py, answers at once) alone vs behind the router; short chat
    prompt, sequential keep-alive requests, alternating batches; overhead = p50(router) - p50(direct).
(3) Streams: ``--streams`` concurrent streaming requests through the router to the canned upstream.

Usage: ``.venv/bin/python bench/router.py [--policies prefix_hash,round_robin,least_load] [--skip-workload]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import VOCAB, free_port, make_log  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "models", "smollm2-135m-instruct")
MODEL = "smollm2-135m-instruct"
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
log = make_log("router")


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def wait_ready(url: str, path: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with status {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url}{path} not ready after {timeout_s} s")


@contextmanager
def process(argv: list[str], url: str, ready_path: str, logfile: str) -> Iterator[subprocess.Popen]:
    with open(logfile, "w") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    try:
        wait_ready(url, ready_path, proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def router_argv(port: int, workers: list[str], policy: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "radixserve",
        "router",
        "--port",
        str(port),
        "--policy",
        policy,
        "--log-level",
        "warning",
        *extra,
        "--worker-urls",
        *workers,
    ]


# ---------------------------------------------------------------- (1) the multi-conversation workload
def make_conversations(n: int, system_tokens: int, turns: int, seed: int = 0) -> list[dict]:
    """n chats, each with its own system prompt of about ``system_tokens`` tokens (~1.3 words per token)."""
    rng = random.Random(seed)
    convs = []
    for i in range(n):
        words = " ".join(rng.choice(VOCAB) for _ in range(int(system_tokens / 1.3)))
        system = f"You are assistant #{i} of ACME Corp, expert in {TOPICS[i % len(TOPICS)]}. Rules: {words}"
        questions = [
            f"Question {t + 1} about {TOPICS[(i + t) % len(TOPICS)]}: what should I know? "
            + " ".join(rng.choice(VOCAB) for _ in range(12))
            for t in range(turns)
        ]
        convs.append({"messages": [{"role": "system", "content": system}], "questions": questions})
    return convs


async def one_turn(
    client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int, forced: bool = False
) -> dict:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if forced:
        body["ignore_eos"] = True  # exactly max_tokens output tokens (SGLang's and vLLM's extra key)
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage = None
    headers = {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        headers = dict(r.headers)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    return {
        "text": "".join(text),
        "usage": usage,
        "ttft": ttft if ttft is not None else time.perf_counter() - t0,
        "worker": headers.get("x-radixserve-worker"),
        "reason": headers.get("x-radixserve-route-reason"),
    }


async def run_workload(url: str, convs: list[dict], turns: int, max_tokens: int, concurrency: int) -> dict:
    convs = [{"messages": list(c["messages"]), "questions": c["questions"]} for c in convs]
    rng = random.Random(1)
    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        for t in range(turns):
            order = list(range(len(convs)))
            rng.shuffle(order)

            async def turn(i: int, t: int) -> None:
                conv = convs[i]
                msgs = conv["messages"] + [{"role": "user", "content": conv["questions"][t]}]
                async with sem:
                    res = await one_turn(client, url, msgs, max_tokens)
                conv["messages"] = msgs + [{"role": "assistant", "content": res["text"]}]
                results.append(res)

            await asyncio.gather(*(turn(i, t) for i in order))
        wall = time.perf_counter() - t0
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in results)
    output = sum(r["usage"]["completion_tokens"] for r in results)
    reasons: dict[str, int] = {}
    for r in results:
        reasons[str(r["reason"])] = reasons.get(str(r["reason"]), 0) + 1
    return {
        "hit_rate": round(cached / prompt, 4),
        "output_tok_s": round(output / wall, 2),
        "mean_ttft_s": round(statistics.mean(r["ttft"] for r in results), 3),
        "wall_s": round(wall, 1),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "reasons": reasons,
    }


def summarize(results: list[dict], wall: float) -> dict:
    """Hit rate (engines' cached tokens / prompt tokens), output tok/s, mean and p99 TTFT, reasons, engines used."""
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in results)
    output = sum(r["usage"]["completion_tokens"] for r in results)
    ttfts = sorted(r["ttft"] for r in results)
    reasons: dict[str, int] = {}
    workers: dict[str, int] = {}
    for r in results:
        reasons[str(r["reason"])] = reasons.get(str(r["reason"]), 0) + 1
        workers[str(r["worker"])] = workers.get(str(r["worker"]), 0) + 1
    return {
        "hit_rate": round(cached / prompt, 4),
        "output_tok_s": round(output / wall, 2),
        "mean_ttft_s": round(statistics.mean(ttfts), 3),
        "p99_ttft_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3),
        "wall_s": round(wall, 1),
        "requests": len(results),
        "reasons": reasons,
        "per_engine": sorted(workers.values(), reverse=True),
    }


def system_prompt(rng: random.Random, tokens: int, tag: str) -> str:
    words = " ".join(rng.choice(VOCAB) for _ in range(int(tokens / 1.3)))
    return f"{tag} You are the support assistant of ACME Corp. Follow these rules: {words}"


async def run_hot_prefix(urls: list[str], n: int, system_tokens: int, max_tokens: int, concurrency: int) -> dict:
    """(c): ``n`` chats sharing one ~``system_tokens`` system prompt (fresh for every run), distinct ~30-token user
    turns, ``max_tokens`` forced output tokens, ``concurrency`` at a time; requests alternate over ``urls``."""
    rng = random.Random()
    system = system_prompt(rng, system_tokens, f"[run {rng.getrandbits(48):012x}]")
    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency * 2)) as client:

        async def one(i: int) -> None:
            user = f"Ticket {i}: " + " ".join(rng.choice(VOCAB) for _ in range(22))
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            async with sem:
                results.append(await one_turn(client, urls[i % len(urls)], msgs, max_tokens, forced=True))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    return summarize(results, wall)


async def run_mixed(
    urls: list[str], hot: int, convs: int, turns: int, system_tokens: int, max_tokens: int, concurrency: int
) -> dict:
    """(d): ``hot`` single-turn chats sharing one hot system prompt (60% of the requests by default) and ``convs``
    distinct ``turns``-turn conversations, each with its own system prompt (40%), all interleaved, ``concurrency``
    at a time; request ``i`` goes to ``urls[i % len(urls)]`` (two routers: alternating)."""
    rng = random.Random()
    nonce = f"[run {rng.getrandbits(48):012x}]"
    hot_system = system_prompt(rng, system_tokens, nonce)
    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []
    counter = iter(range(10**9))
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency * 2)) as client:

        async def send(msgs: list[dict]) -> dict:
            async with sem:
                res = await one_turn(client, urls[next(counter) % len(urls)], msgs, max_tokens, forced=True)
            results.append(res)
            return res

        async def hot_one(i: int) -> None:
            await asyncio.sleep(0.05 * i)  # spread over the run, as the conversations are
            user = f"Ticket {i}: " + " ".join(rng.choice(VOCAB) for _ in range(22))
            await send([{"role": "system", "content": hot_system}, {"role": "user", "content": user}])

        async def conversation(c: int) -> None:
            system = system_prompt(rng, system_tokens // 2, f"{nonce} [conversation {c}]")
            msgs = [{"role": "system", "content": system}]
            for t in range(turns):
                msgs.append({"role": "user", "content": f"Turn {t}: " + " ".join(rng.choice(VOCAB) for _ in range(16))})
                res = await send(list(msgs))
                msgs.append({"role": "assistant", "content": res["text"]})

        t0 = time.perf_counter()
        await asyncio.gather(*(hot_one(i) for i in range(hot)), *(conversation(c) for c in range(convs)))
        wall = time.perf_counter() - t0
    return summarize(results, wall)


def hot_prefix_bench(args: argparse.Namespace, tmp: str, urls: list[str]) -> dict:
    """(c) and (d) against engines already running at ``urls`` (one thread each), caches flushed before each run."""
    out: dict = {}
    c = (args.hot_requests, args.hot_system_tokens, args.hot_max_tokens, args.concurrency)
    flush(urls)
    out["single_1thread"] = asyncio.run(run_hot_prefix(urls[:1], *c))
    log(f"(c) one engine, one thread: {out['single_1thread']}")
    flush(urls)
    # The ceiling for any router: the requests split evenly over the engines by the client, no router in between.
    out["ideal_split"] = asyncio.run(run_hot_prefix(urls, *c))
    log(f"(c) {len(urls)} engines, requests alternated by the client (no router): {out['ideal_split']}")
    variants = {"replicated": (), "no_replication": ("--hot-prefix-half-life-s", "0")}
    for name, extra in variants.items():
        flush(urls)
        rport = free_port()
        rurl = f"http://127.0.0.1:{rport}"
        with process(
            router_argv(rport, urls, "prefix_hash", extra), rurl, "/ready", os.path.join(tmp, f"c-{name}.log")
        ):
            out[f"stack_{name}"] = asyncio.run(run_hot_prefix([rurl], *c))
        log(f"(c) stack, prefix_hash {name}: {out[f'stack_{name}']}")
    single = out["single_1thread"]
    out["ratios"] = {
        f"{n}_vs_single_tok_s": round(out[n]["output_tok_s"] / single["output_tok_s"], 3)
        for n in ("ideal_split", *(f"stack_{v}" for v in variants))
    }

    m = (args.mix_hot, args.mix_conversations, args.mix_turns, args.hot_system_tokens, args.hot_max_tokens)
    mixed: dict = {}
    runs = {
        "prefix_hash": ("prefix_hash", ()),
        "prefix_hash_no_replication": ("prefix_hash", ("--hot-prefix-half-life-s", "0")),
        "least_load": ("least_load", ()),
    }
    for name, (policy, extra) in runs.items():
        flush(urls)
        rport = free_port()
        rurl = f"http://127.0.0.1:{rport}"
        with process(router_argv(rport, urls, policy, extra), rurl, "/ready", os.path.join(tmp, f"d-{name}.log")):
            mixed[name] = asyncio.run(run_mixed([rurl], *m, args.concurrency))
        log(f"(d) {name}: {mixed[name]}")
    flush(urls)
    ports = [free_port(), free_port()]
    rurls = [f"http://127.0.0.1:{p}" for p in ports]
    with (
        process(router_argv(ports[0], urls, "prefix_hash"), rurls[0], "/ready", os.path.join(tmp, "d-r1.log")),
        process(router_argv(ports[1], urls, "prefix_hash"), rurls[1], "/ready", os.path.join(tmp, "d-r2.log")),
    ):
        mixed["prefix_hash_2_routers"] = asyncio.run(run_mixed(rurls, *m, args.concurrency))
    log(f"(d) prefix_hash, 2 routers: {mixed['prefix_hash_2_routers']}")
    out["mixed"] = mixed
    out["ratios"].update(
        mixed_hit_vs_no_replication=round(
            mixed["prefix_hash"]["hit_rate"] / mixed["prefix_hash_no_replication"]["hit_rate"], 3
        ),
        mixed_p99_ttft_vs_least_load=round(mixed["prefix_hash"]["p99_ttft_s"] / mixed["least_load"]["p99_ttft_s"], 3),
        two_routers_hit_vs_one=round(mixed["prefix_hash_2_routers"]["hit_rate"] / mixed["prefix_hash"]["hit_rate"], 3),
    )
    return out


def flush(urls: list[str]) -> None:
    for u in urls:
        r = httpx.post(u + "/flush_cache", timeout=60)
        if r.status_code != 200:
            raise RuntimeError(f"flush_cache on {u}: {r.status_code} {r.text}")


def workload_bench(args: argparse.Namespace, tmp: str) -> dict:
    convs = make_conversations(args.conversations, args.system_tokens, args.turns)
    ports = [free_port() for _ in range(args.engines)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    out: dict = {"policies": {}}
    try:
        for i, port in enumerate(ports):
            argv = [
                sys.executable,
                "-m",
                "radixserve",
                "engine",
                "--model-path",
                MODEL_DIR,
                "--port",
                str(port),
                "--num-threads",
                str(args.threads_per_engine),
                "--context-length",
                "4096",
                "--log-level",
                "warning",
            ]
            f = open(os.path.join(tmp, f"engine{i}.log"), "w")
            procs.append(subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT))
        for url, proc in zip(urls, procs):
            wait_ready(url, "/health", proc)
        log(f"{args.engines} engines ready: {urls}")

        policies = [] if args.only_hot_prefix else args.policies.split(",")
        if policies:
            flush(urls)
            single = asyncio.run(run_workload(urls[0], convs, args.turns, args.max_tokens, args.concurrency))
            out["single_engine_hit_rate"] = single["hit_rate"]
            out["single_engine"] = single
            log(f"single engine: {single}")
        for policy in policies:
            flush(urls)
            rport = free_port()
            rurl = f"http://127.0.0.1:{rport}"
            with process(router_argv(rport, urls, policy), rurl, "/ready", os.path.join(tmp, f"router-{policy}.log")):
                res = asyncio.run(run_workload(rurl, convs, args.turns, args.max_tokens, args.concurrency))
            out["policies"][policy] = res
            log(f"{policy}: {res}")
        if not args.skip_hot_prefix:
            out["hot_prefix"] = hot_prefix_bench(args, tmp, urls)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    return out


# ---------------------------------------------------------------- (2) overhead and (3) concurrent streams
def overhead_bench(args: argparse.Namespace, tmp: str) -> dict:
    up_port, r_port = free_port(), free_port()
    up_url, r_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{r_port}"
    tok_args = ["--tokenizer-dir", MODEL_DIR] if os.path.isdir(MODEL_DIR) else []
    up_argv = [
        sys.executable,
        os.path.join(ROOT, "bench", "canned_upstream.py"),
        "--port",
        str(up_port),
        "--chunks",
        "16",
        "--chunk-interval-ms",
        str(args.stream_chunk_ms),
        *tok_args,
    ]
    body = {"model": "canned", "messages": [{"role": "user", "content": "Hi, how are you?"}], "max_tokens": 8}
    out: dict = {}
    with (
        process(up_argv, up_url, "/health", os.path.join(tmp, "canned.log")),
        process(router_argv(r_port, [up_url], "prefix_hash"), r_url, "/ready", os.path.join(tmp, "router.log")),
    ):
        lat: dict[str, list[float]] = {"direct": [], "router": []}
        with httpx.Client(timeout=30) as client:
            for base in (up_url, r_url):  # warm-up: connections, tokenizer, code paths
                for _ in range(200):
                    client.post(base + "/v1/chat/completions", json=body).raise_for_status()
            for _ in range(args.overhead_rounds):
                for name, base in (("direct", up_url), ("router", r_url)):
                    for _ in range(100):
                        t0 = time.perf_counter()
                        r = client.post(base + "/v1/chat/completions", json=body)
                        lat[name].append(time.perf_counter() - t0)
                        r.raise_for_status()
        direct, routed = statistics.median(lat["direct"]), statistics.median(lat["router"])
        out.update(
            direct_p50_ms=round(direct * 1e3, 3),
            router_p50_ms=round(routed * 1e3, 3),
            router_overhead_p50_ms=round((routed - direct) * 1e3, 3),
            overhead_samples=len(lat["router"]),
        )
        log(f"overhead: {out}")
        out["streams"] = asyncio.run(many_streams(r_url, args.streams))
        log(f"streams: {out['streams']}")
    return out


async def many_streams(url: str, n: int) -> dict:
    body = {
        "model": "canned",
        "messages": [{"role": "user", "content": "stream please"}],
        "max_tokens": 16,
        "stream": True,
    }
    errors: list[str] = []
    chunks_seen: list[int] = []
    limits = httpx.Limits(max_connections=n + 16, max_keepalive_connections=n + 16)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=60, pool=120), limits=limits) as client:

        async def one() -> None:
            try:
                count = 0
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(f"HTTP {r.status_code}: {(await r.aread())[:160].decode(errors='replace')}")
                        return
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            count += 1
                chunks_seen.append(count)
                if count != 17:  # 16 chunks + [DONE]
                    errors.append(f"{count} events")
            except Exception as e:  # noqa: BLE001 - counted and reported
                errors.append(type(e).__name__)

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        wall = time.perf_counter() - t0
    kinds: dict[str, int] = {}
    for e in errors:
        kinds[e] = kinds.get(e, 0) + 1
    return {"concurrent": n, "errors": len(errors), "error_kinds": kinds, "wall_s": round(wall, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="prefix_hash,round_robin,least_load")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--threads-per-engine", type=int, default=1)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--overhead-rounds", type=int, default=10)
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--stream-chunk-ms", type=float, default=50.0)
    p.add_argument("--hot-requests", type=int, default=32, help="(c): chats sharing one system prompt")
    p.add_argument("--hot-system-tokens", type=int, default=800, help="(c), (d): hot system prompt tokens")
    p.add_argument("--hot-max-tokens", type=int, default=64, help="(c), (d): forced output tokens")
    p.add_argument("--mix-hot", type=int, default=48, help="(d): requests sharing the hot system prompt")
    p.add_argument("--mix-conversations", type=int, default=8, help="(d): distinct conversations")
    p.add_argument("--mix-turns", type=int, default=4, help="(d): turns per conversation")
    p.add_argument("--skip-hot-prefix", action="store_true", help="skip (c) and (d)")
    p.add_argument("--only-hot-prefix", action="store_true", help="run only (c) and (d) of the workloads")
    p.add_argument("--skip-workload", action="store_true")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--log-dir", default=None, help="keep process logs here (default: a temporary directory)")
    args = p.parse_args()
    raise_nofile()
    import tempfile

    tmp = args.log_dir or tempfile.mkdtemp(prefix="bench-router-")
    os.makedirs(tmp, exist_ok=True)
    log(f"process logs in {tmp}")
    result: dict = {}
    if not args.skip_workload:
        result.update(workload_bench(args, tmp))
    if not args.skip_overhead:
        result.update(overhead_bench(args, tmp))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
