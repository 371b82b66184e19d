"""A fake of the Engine boundary (engine/engine.py's ``Engine`` interface) for testing the HTTP layer alone.

It uses the real tokenizer and emits scripted ``ReqOutput`` deltas: sample ``i`` of a request produces the token ids
of ``script`` rotated by ``i`` tokens (or, after ``set_outputs(texts)``, the tokens of ``texts[i % len(texts)]``),
one token per step, ``delay_s`` seconds apart, until ``max_new_tokens`` (finish "length") or the end of the script
(finish "stop", matched eos). Text deltas are decoded incrementally and never end in half a character. With
``logprob_start_len`` the first delta of each sample carries scripted prompt logprobs (``prompt_logprobs``), and
``max_new_tokens == 0`` scores the prompt and generates nothing. It records every request it received and every
request aborted before finishing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from transformers import AutoTokenizer

from radixserve.engine.config import EngineArgs
from radixserve.engine.engine import parse_sampling_defaults
from radixserve.engine.io_struct import GenerateRequest, InvalidRequestError, ReqOutput, TokenLogprob
from radixserve.engine.memory.cache_events import CacheEventLog
from radixserve.engine.metrics import EngineMetrics

if TYPE_CHECKING:
    from radixserve.engine.server.engine_client import EngineClient

MODEL_DIR = str(Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct")
SCRIPT = "Hello there! Ünïcödé café, 日本語 🙂 and the end."


def load_tokenizer() -> Any:
    """The demo model's real tokenizer."""
    return AutoTokenizer.from_pretrained(MODEL_DIR)


class FakeEngine:
    """Scripted stand-in for ``Engine``: implements ``EngineClient`` (engine/server/engine_client.py), which mypy
    checks below. ``generate`` ignores grammars; ``check_grammar`` accepts any unless a test sets
    ``grammar_backend``."""

    def __init__(self, tokenizer: Any, context_length: int = 2048, delay_s: float = 0.0, **arg_overrides: Any):
        self.args = EngineArgs(model_path=MODEL_DIR, context_length=context_length, **arg_overrides)
        self.sampling_defaults = parse_sampling_defaults(self.args.preferred_sampling_params)
        self.tokenizer = tokenizer
        self.served_model_name = "smollm2-135m-instruct"
        self.context_length = context_length
        self.vocab_size = 49152
        self.metrics = EngineMetrics(self.served_model_name)
        self.delay_s = delay_s
        self.script_ids: list[int] = tokenizer.encode(SCRIPT)
        self.outputs: list[list[int]] | None = None  # set_outputs(): per-sample scripted replies
        self.eos_id = 2
        self.cached_tokens = 0
        self.grammar_backend: Any = None  # set by a test: check_grammar compiles with it (``await get(kind, text)``)
        self.fail_with: InvalidRequestError | None = None  # raised when a generation starts
        self.fail_after_first: Exception | None = None  # raised after the first delta (mid-stream error)
        self.healthy = True
        self.started = False
        self.stopped = False
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.aborted_by_call: list[str] = []
        self.running: set[str] = set()
        # GET /cache_events, /cache_snapshot, /load: a real event log (nothing writes it unless a test does) and
        # a scripted load.
        bt = self.args.cache_event_block_tokens
        self.cache_events: CacheEventLog | None = CacheEventLog(self.served_model_name, bt) if bt else None
        self.load: dict[str, int] = {
            "queued_requests": 0,
            "queued_prefill_tokens": 0,
            "running_requests": 0,
            "running_tokens": 0,
            "max_total_tokens": 4096,
        }

    # ---- lifecycle
    def start(self) -> None:
        self.started = True

    def shutdown(self) -> None:
        self.stopped = True

    def is_healthy(self) -> bool:
        return self.healthy and not self.stopped

    async def health_generate(self, timeout_s: float = 20) -> bool:
        return self.is_healthy()

    async def flush_cache(self) -> bool:
        return not self.running

    def abort(self, rid: str) -> None:
        self.aborted_by_call.append(rid)

    def load_snapshot(self) -> dict[str, int]:
        return dict(self.load)

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.args.model_path,
            "served_model_name": self.served_model_name,
            "context_length": self.context_length,
            "max_total_tokens": 4096,
        }

    # ---- generation
    def set_outputs(self, texts: list[str]) -> None:
        """Script the replies: sample ``i`` produces the tokens of ``texts[i % len(texts)]`` (then eos)."""
        self.outputs = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]

    def sample_ids(self, index: int) -> list[int]:
        """The token ids sample ``index`` produces (before max_new_tokens cuts it)."""
        if self.outputs is not None:
            return self.outputs[index % len(self.outputs)]
        k = index % len(self.script_ids)
        return self.script_ids[k:] + self.script_ids[:k]

    def logprob_of(self, step: int, token_id: int, k: int) -> TokenLogprob:
        lp = -0.1 - 0.25 * (step % 4)
        top = [(token_id, lp)] + [((token_id + j) % self.vocab_size, lp - j) for j in range(1, k)]
        return TokenLogprob(token_id=token_id, logprob=lp, top=top[:k])

    def prompt_logprobs(self, req: GenerateRequest) -> list[TokenLogprob | None] | None:
        """The scripted ``input_token_logprobs`` of ``req``: prompt position ``p`` (from ``logprob_start_len`` on)
        scored as ``logprob_of(p, input_ids[p], top_logprobs_num)``; None at position 0, as the engine's."""
        if req.logprob_start_len is None:
            return None
        k = req.top_logprobs_num
        return [
            None if p == 0 else self.logprob_of(p, req.input_ids[p], k)
            for p in range(req.logprob_start_len, len(req.input_ids))
        ]

    async def check_grammar(self, kind: str, text: str) -> None:
        if self.grammar_backend is not None:  # a test's stand-in: raises for the grammars it refuses
            await self.grammar_backend.get(kind, text)

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[ReqOutput, None]:
        self.requests.append(req)
        if self.fail_with is not None:
            raise self.fail_with
        sp = req.sampling_params
        assert isinstance(sp.max_new_tokens, int), "the server must resolve max_new_tokens"
        n = sp.n
        done = [False] * n
        sent_text = [""] * n
        self.running.add(req.rid)
        try:
            prompt_lps = self.prompt_logprobs(req)
            if sp.max_new_tokens == 0:  # a prompt scored, nothing generated (the server answers the others itself)
                await asyncio.sleep(self.delay_s)
                for i in range(n):
                    yield ReqOutput(
                        rid=req.rid,
                        index=i,
                        text="",
                        token_ids=[],
                        logprobs=[] if req.return_logprob else None,
                        finish_reason={"type": "length", "matched": None},
                        prompt_tokens=len(req.input_ids),
                        completion_tokens=0,
                        cached_tokens=min(self.cached_tokens, len(req.input_ids)),
                        input_token_logprobs=prompt_lps,
                    )
                    done[i] = True
            step = 0
            while not all(done):
                await asyncio.sleep(self.delay_s)
                for i in range(n):
                    if done[i]:
                        continue
                    ids = self.sample_ids(i)
                    produced = ids[: step + 1]
                    finish: dict[str, Any] | None = None
                    if step + 1 >= sp.max_new_tokens:
                        finish = {"type": "length", "matched": None}
                    elif step + 1 >= len(ids):
                        finish = {"type": "stop", "matched": self.eos_id}
                    full = self.tokenizer.decode(produced)
                    if finish is None and full.endswith("\ufffd"):
                        full = sent_text[i]  # hold back half a character
                    delta, sent_text[i] = full[len(sent_text[i]) :], full
                    tok = produced[-1]
                    yield ReqOutput(
                        rid=req.rid,
                        index=i,
                        text=delta,
                        token_ids=[tok],
                        logprobs=[self.logprob_of(step, tok, req.top_logprobs_num)] if req.return_logprob else None,
                        finish_reason=finish,
                        prompt_tokens=len(req.input_ids),
                        completion_tokens=step + 1,
                        cached_tokens=min(self.cached_tokens, len(req.input_ids)),
                        input_token_logprobs=prompt_lps if step == 0 else None,
                    )
                    if finish is not None:
                        done[i] = True
                    if step == 0 and self.fail_after_first is not None:
                        raise self.fail_after_first
                step += 1
        finally:
            self.running.discard(req.rid)
            if not all(done):
                self.aborted.append(req.rid)


if TYPE_CHECKING:

    def _conforms(engine: FakeEngine) -> EngineClient:
        return engine  # mypy: FakeEngine implements the EngineClient protocol


def sse_payloads(body: str) -> list[Any]:
    """Parse an SSE body: checks the framing (``data: <json>`` events separated by blank lines, ending with
    ``data: [DONE]``) and returns the decoded JSON payloads in order (without the ``[DONE]``)."""
    import json

    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = body.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for ev in events[:-2]:
        assert ev.startswith("data: "), ev
        payloads.append(json.loads(ev[len("data: ") :]))
    assert events[-2] == "data: [DONE]"
    return payloads


class ServerThread:
    """A uvicorn server for ``app`` on a free 127.0.0.1 port in a background thread (context manager → base URL)."""

    def __init__(self, app: Any):
        import socket

        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        import threading
        import time

        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def wait_until(cond: Any, timeout_s: float = 20.0) -> bool:
    """Poll ``cond()`` every 50 ms until true or ``timeout_s`` passes; returns its last value."""
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return bool(cond())
        time.sleep(0.05)
    return True


# ---- pytest fixtures shared by the HTTP-layer tests (import them into a test module to use them)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()


@pytest.fixture
def engine(tokenizer: Any, request: Any) -> FakeEngine:
    """A fresh fake engine; a test module may set ``FAKE_CONTEXT_LENGTH`` (default 2048 tokens)."""
    return FakeEngine(tokenizer, context_length=getattr(request.module, "FAKE_CONTEXT_LENGTH", 2048))


@pytest.fixture
def client(engine: FakeEngine) -> Any:
    from fastapi.testclient import TestClient

    from radixserve.engine.server.http import create_app

    return TestClient(create_app(engine, manage_engine=False), raise_server_exceptions=False)
