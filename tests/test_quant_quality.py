"""Quality of the quantized demo model (issue 14, item 4): perplexity on a fixed text shipped with the tests
(tests/data/perplexity.txt) of the GGUF served as stored, and of the dense checkpoint quantized on load, against the
dequantized bfloat16 model. Loads the real model several times: marked slow."""

from __future__ import annotations

import math
import os

import pytest
import torch

from radixserve.engine.engine import load_tokenizer
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.model.forward_context import forward_context
from radixserve.engine.model.runner import ModelRunner

from conftest import MODEL_DIR, demo_gguf, requires_demo_gguf, requires_model

pytestmark = [pytest.mark.slow, requires_model]

TEXT = os.path.join(os.path.dirname(__file__), "data", "perplexity.txt")


@pytest.fixture(scope="module")
def text_ids() -> list[int]:
    with open(TEXT, encoding="utf-8") as f:
        ids: list[int] = load_tokenizer(MODEL_DIR).encode(f.read())
    assert 250 < len(ids) < 1000
    return ids


def perplexity(runner: ModelRunner, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ``ids[1:]``, each token predicted from the ones before it (one prefill
    whose logits are taken at every position)."""
    batch = ForwardBatch.build(ForwardMode.EXTEND, [ids], [list(range(1, len(ids) + 1))])
    runner.attn_backend.init_forward_metadata(batch)
    every_row = torch.arange(len(ids) - 1)
    with torch.inference_mode(), forward_context(batch, runner.kv_pool, runner.attn_backend):
        logits = runner.model(batch.input_ids, batch.positions, every_row, None)
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


def _runner(path: str, **extra: object) -> ModelRunner:
    return ModelRunner(path, dtype="bfloat16", device="cpu", max_total_tokens=1024, num_threads=2, **extra)


@pytest.fixture(scope="module")
def bf16_perplexity(text_ids) -> float:
    return perplexity(_runner(MODEL_DIR), text_ids)


@requires_demo_gguf
def test_the_gguf_served_as_stored_is_within_1_percent_of_the_dequantized_model(text_ids, bf16_perplexity):
    served = perplexity(_runner(str(demo_gguf()), quantization="gguf"), text_ids)
    assert 1.5 < bf16_perplexity < 100  # a model that reads the text, not noise
    assert abs(served / bf16_perplexity - 1) < 0.01, (served, bf16_perplexity)


@pytest.mark.parametrize("torchao_config", ["int8wo", "int4wo-32"])
def test_quantized_on_load_stays_within_1_percent_of_the_bf16_model(text_ids, bf16_perplexity, torchao_config):
    """int8 per channel, and int4 in groups of 32 (the GGUF's own Q4_1 grid, so its weights come back nearly
    exactly). Wider int4 groups put the demo model's already 4-bit weights on a coarser grid: measured 1.4x the
    perplexity at int4wo-64 and 2.0x at int4wo-128 (engine/model/quant/on_load.py), so they are not held to 1%."""
    quantized = perplexity(_runner(MODEL_DIR, torchao_config=torchao_config), text_ids)
    assert abs(quantized / bf16_perplexity - 1) < 0.01, (torchao_config, quantized, bf16_perplexity)
