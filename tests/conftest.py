"""Shared test settings: the real demo model's location and markers."""

from __future__ import annotations

import os
import socket

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "models", "smollm2-135m-instruct")

# 2-core machines: more threads than cores collapses throughput.
torch.set_num_threads(min(2, os.cpu_count() or 1))

requires_model = pytest.mark.skipif(
    not os.path.exists(os.path.join(MODEL_DIR, "config.json")),
    reason="demo model not converted; run `make install`",
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound, then released, for a server to take)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# CI runs with CI=true: derandomized hypothesis, so a landing never hinges on a lucky draw; local runs explore anew.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    _hypothesis_settings.load_profile("ci")
