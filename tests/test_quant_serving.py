"""The demo GGUF served as stored (``radixserve engine --quantization gguf``) through the OpenAI API, with the
official ``openai`` client: a real engine process, streamed and non-streamed, greedy text equal either way, a
repeated prompt served from the radix cache, and the start-up line naming the quantized weights."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI

from conftest import ROOT, demo_gguf, free_port, requires_demo_gguf, requires_model, wait_healthy

pytestmark = [requires_model, pytest.mark.slow]


@requires_demo_gguf
def test_the_gguf_served_as_stored_answers_the_openai_api(tmp_path):
    port = free_port()
    log_path = tmp_path / "engine.log"
    # eager: the compiled quantized forward is tests/test_quant_gguf.py's (a cold compile here would double the time)
    flags = ["--quantization", "gguf", "--disable-torch-compile", "--port", str(port), "--max-total-tokens", "4096"]
    flags += ["--num-threads", "2"]
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve", "engine", "--model-path", str(demo_gguf()), *flags],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc, 300, log_path)
            client = OpenAI(base_url=url + "/v1", api_key="none")
            model = client.models.list().data[0].id
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
            text = reply.choices[0].message.content
            assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 24
            # the 135M model at 4 bits knows little: text, not facts (tests/test_quant_quality.py holds the quality)
            assert text and text.strip()
            stream = client.chat.completions.create(
                model=model, messages=messages, max_tokens=24, temperature=0, stream=True
            )
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert streamed == text
            again = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
            details = again.usage.prompt_tokens_details if again.usage else None
            assert details is not None and details.cached_tokens  # the radix cache serves the quantized model too
            info = httpx.get(url + "/get_model_info", timeout=10).json()
            # 134.5 M parameters: 269 MB in bfloat16. Served: 4-bit projections (66 MB), the file's Q8_0 embedding
            # (30 MB) and the tied LM head in bfloat16 (57 MB)
            assert info["quantization"] == "gguf" and info["kv_pool_bytes"] > 0
            assert 0 < info["weight_bytes"] < 0.6 * 269e6
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        startup = log_path.read_text()
    assert "weights quantized (gguf)" in startup and "(gguf), KV pool" in startup
