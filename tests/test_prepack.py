"""oneDNN-prepacked weights (engine/model/prepack.py): the packed GEMM equals F.linear, a prepacked model gives the
dense model's greedy tokens, releases the dense copies, and its packed weights go with it."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from radixserve.engine.model import prepack
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.model.llama import Linear
from radixserve.engine.model.runner import ModelRunner
from test_model import _tiny_configs

CPU = torch.device("cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if prepack.prepack_supported(torch.bfloat16, CPU) else [])


class _Owner:
    """Something a packed weight's lifetime can hang on."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 100])
def test_packed_linear_equals_f_linear(dtype, bias, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    owner = _Owner()
    handle = prepack.pack_linear(owner, w, b)
    got = prepack.packed_linear(x, handle, 96)
    assert got.shape == (rows, 96) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), atol=tol, rtol=tol)


def test_a_packed_weight_goes_with_its_owner():
    owner = _Owner()
    handle = prepack.pack_linear(owner, torch.randn(8, 4), None)
    assert prepack.packed_bytes(handle) == 8 * 4 * 4
    del owner
    gc.collect()
    with pytest.raises(KeyError):
        prepack.packed_bytes(handle)


def test_prepack_is_cpu_only():
    assert not prepack.prepack_supported(torch.float32, torch.device("meta"))
    assert not prepack.prepack_supported(torch.int8, CPU)


def _tiny_dir(name: str, tmp_path) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_tiny_configs()[name], dtype=torch.float32)
    with torch.no_grad():  # random biases, so a dropped bias would show
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return str(tmp_path)


def _greedy(runner: ModelRunner, prompt: list[int], n_new: int) -> tuple[list[int], torch.Tensor]:
    slots = list(range(1, len(prompt) + n_new + 1))
    logits = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [prompt], [slots[: len(prompt)]]))
    out = [int(logits.argmax(-1)[0])]
    for step in range(n_new - 1):
        ctx = slots[: len(prompt) + step + 1]
        logits = runner.forward(ForwardBatch.build(ForwardMode.DECODE, [[out[-1]]], [ctx]))
        out.append(int(logits.argmax(-1)[0]))
    return out, logits


@pytest.mark.parametrize("name", ["llama-llama3-rope", "qwen2-bias-yarn"])  # untied LM head; tied + q/k/v bias
def test_a_prepacked_model_gives_the_dense_models_tokens(name, tmp_path):
    path = _tiny_dir(name, tmp_path)
    dense = ModelRunner(path, dtype="float32", device="cpu", max_total_tokens=256, weight_prepack=False)
    packed = ModelRunner(path, dtype="float32", device="cpu", max_total_tokens=256, weight_prepack=True)
    assert packed.prepacked and not dense.prepacked
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.pack_handle is not None and m.weight.numel() == 0 for m in linears)
    tied = packed.model.lm_head is None
    assert (packed.model.lm_head_pack is not None) == tied
    embed = packed.model.model.embed_tokens.weight
    # the same bytes as dense, plus the tied LM head's packed copy and an int64 handle per packed matrix
    extra = (embed.numel() * embed.element_size() if tied else 0) + 8 * (len(linears) + tied)
    assert packed.weight_bytes() == dense.weight_bytes() + extra
    prompt = torch.randint(3, 160, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    want, want_logits = _greedy(dense, prompt, 12)
    got, got_logits = _greedy(packed, prompt, 12)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)


def test_deterministic_inference_keeps_prepacked_weights_batch_invariant(tmp_path):
    """With the flag the packed GEMMs run in fixed row chunks: a sequence's logits are the same bits alone and beside
    others (the prepacked path once ignored the flag, and the real model's seeded text changed beside others)."""
    path = _tiny_dir("mistral", tmp_path)
    runner = ModelRunner(
        path, dtype="float32", device="cpu", max_total_tokens=256, deterministic=True, weight_prepack=True
    )
    assert runner.prepacked and runner.model.batch_invariant
    assert all(m.pack_handle is not None and m.batch_invariant for m in runner.model.modules() if isinstance(m, Linear))
    gen = torch.Generator().manual_seed(3)
    target, other = (
        torch.randint(3, 160, (13,), generator=gen).tolist(),
        torch.randint(3, 160, (30,), generator=gen).tolist(),
    )
    alone = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [target], [list(range(1, 14))]))[0]
    beside = runner.forward(
        ForwardBatch.build(ForwardMode.EXTEND, [other, target], [list(range(20, 50)), list(range(60, 73))])
    )[1]
    assert torch.equal(alone, beside)


def test_by_default_only_half_precision_is_prepacked(tmp_path):
    """float32 stays dense unless asked (MKL's GEMV is faster at batch-1 decode, ``prepack_pays``); bfloat16 is
    packed where oneDNN supports it."""
    path = _tiny_dir("mistral", tmp_path)
    assert not ModelRunner(path, dtype="float32", device="cpu", max_total_tokens=256).prepacked
    bf16 = ModelRunner(path, dtype="bfloat16", device="cpu", max_total_tokens=256)
    assert bf16.prepacked == prepack.prepack_supported(torch.bfloat16, CPU)
    assert not ModelRunner(path, dtype="bfloat16", device="cpu", max_total_tokens=256, weight_prepack=False).prepacked
