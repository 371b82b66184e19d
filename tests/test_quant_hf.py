"""A dense checkpoint quantized at load (``--torchao-config``, engine/model/quant/on_load.py): the int4 group and
int8 channel schemes within half a scale step of the weight, the kernels against the dequantized weight, the config
names, and a tiny HF checkpoint whose quantized runner gives the logits of the dense model carrying the dequantized
weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.engine import config as engine_config
from radixserve.engine.config import engine_args_from_namespace
from radixserve.engine.model.batch_invariant import row_invariance_violations
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.model.quant.affine import GROUP
from radixserve.engine.model.quant.int4_cpu import int4_mm, pack
from radixserve.engine.model.quant.int8_cpu import DEQUANT_ROWS, int8_linear, quantize_int8_channels
from radixserve.engine.model.quant.int8_linear import Int8Linear
from radixserve.engine.model.quant.linear import Int4Linear
from radixserve.engine.model.quant.on_load import PROJECTIONS, WeightOnlyConfig, quantize_int4_groups
from radixserve.engine.model.runner import ModelRunner
from radixserve.launch.cli import build_parser, main
from test_model import _tiny_configs


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_the_config_names_are_the_flags_choices():
    for name in engine_config.TORCHAO_CONFIGS:
        cfg = WeightOnlyConfig.parse(name)
        assert cfg.name == name and cfg.bits in (4, 8)
    assert WeightOnlyConfig.parse("int4wo-128").group_size == 128
    for bad in ("int4wo-100", "int4wo", "fp8wo", "int8"):
        with pytest.raises(ValueError, match="choose one of int8wo, int4wo-32"):
            WeightOnlyConfig.parse(bad)


@pytest.mark.parametrize("group_size, k", [(32, 96), (64, 128), (128, 576), (256, 256)])
def test_int4_groups_stay_within_half_a_step_of_the_weight(group_size, k):
    """|w - dequantized| <= scale / 2 (plus the float32 rounding of the product), one scale per group of
    ``group_size`` (a K that is not a multiple of it: 576 = 4 x 128 + 64 ends in a narrower group)."""
    w = _weight(48, k)
    q = quantize_int4_groups(w, group_size, torch.float32)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    step = q.scale.float().repeat_interleave(GROUP, dim=1)
    assert bool(((w - q.dense(torch.float32)).abs() <= step / 2 + 1e-6).all())
    groups = q.scale.view(48, -1)
    for start in range(0, k // GROUP, group_size // GROUP):  # 32-wide groups of one G-group share a scale
        assert bool((groups[:, start : start + group_size // GROUP] == groups[:, start : start + 1]).all())


def test_a_constant_int4_group_is_exact():
    w = torch.full((16, 64), 0.25)
    assert torch.equal(quantize_int4_groups(w, 32, torch.float32).dense(torch.float32), w)


def test_int4_groups_refuse_a_k_the_kernel_cannot_group():
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize_int4_groups(_weight(16, 40), 32, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_int4_groups_through_the_kernel_are_the_dequantized_weight(dtype):
    w = quantize_int4_groups(_weight(64, 128, seed=1), 64, dtype)
    p = pack(w, dtype)
    got = int4_mm(torch.eye(128, dtype=dtype), p.weight, p.scale_zeros, p.input_copies).T.float()
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, w.dense(torch.float32), atol=tol * 0.05, rtol=tol)


def test_int8_channels_stay_within_half_a_step_and_a_zero_row_is_zero():
    w = _weight(32, 64)
    w[3] = 0
    q = quantize_int8_channels(w, torch.float32)
    assert q.codes.dtype == torch.int8 and int(q.codes.abs().max()) <= 127
    assert bool(((w - q.dense(torch.float32)).abs() <= q.scale[:, None] / 2 + 1e-7).all())
    assert torch.equal(q.dense(torch.float32)[3], torch.zeros(64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_kernel_and_dequantized_rows_agree_and_the_kernel_is_row_invariant(dtype):
    q = quantize_int8_channels(_weight(96, 64), dtype)
    x = torch.randn(DEQUANT_ROWS + 9, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = F.linear(x.float(), q.dense(torch.float32))
    kernel = int8_linear(x, q.codes, q.scale, -1)
    hybrid = int8_linear(x, q.codes, q.scale)  # above DEQUANT_ROWS: the dequantized weight
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel.float(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(hybrid.float(), want, atol=tol, rtol=tol)
    assert row_invariance_violations(lambda t: int8_linear(t, q.codes, q.scale, -1), x, [1, 3, 8], [0, 5]) == []


def _tiny_checkpoint(tmp_path, name: str) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _tiny_configs()[name]
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = str(tmp_path / name)
    hf.save_pretrained(path, safe_serialization=True)
    return path


def _dequantized_reference(dense: ModelRunner, quant: ModelRunner) -> None:
    """Write each quantized projection's dequantized weight into the dense runner's matching ``Linear``."""
    for dense_layer, quant_layer in zip(dense.model.model.layers, quant.model.model.layers):
        for path in PROJECTIONS:
            q, d = quant_layer.get_submodule(path), dense_layer.get_submodule(path)
            n, k = q.out_features, q.in_features
            if isinstance(q, Int8Linear):
                assert q.codes is not None and q.scale is not None
                w = q.codes.float() * q.scale.float()[:, None]
            else:
                assert isinstance(q, Int4Linear) and q.qweight is not None and q.scale_zeros is not None
                w = int4_mm(torch.eye(k), q.qweight, q.scale_zeros, q.input_copies).T
            d.weight.data.copy_(w.reshape(n, k))


@pytest.mark.parametrize("torchao_config", ["int8wo", "int4wo-64"])
@pytest.mark.parametrize("name", ["llama-llama3-rope", "qwen2-bias-yarn"])
def test_a_tiny_checkpoint_quantized_on_load_runs_its_dequantized_weights(name, torchao_config, tmp_path):
    """Every projection swapped, fewer bytes, and the logits (a prefill above the dequantize threshold and decode
    steps below it) those of the dense model carrying the dequantized weights: the quantized kernels compute
    exactly the model the codes stand for."""
    path = _tiny_checkpoint(tmp_path, name)
    kw = dict(dtype="float32", device="cpu", max_total_tokens=128, weight_prepack=False)
    dense = ModelRunner(path, **kw)
    quant = ModelRunner(path, torchao_config=torchao_config, **kw)
    kind = Int8Linear if torchao_config == "int8wo" else Int4Linear
    swapped = [m for m in quant.model.modules() if isinstance(m, kind)]
    assert len(swapped) == len(PROJECTIONS) * len(quant.model.model.layers)
    assert quant.weight_bytes() < dense.weight_bytes()
    assert quant.quantization == torchao_config
    _dequantized_reference(dense, quant)
    prompt = torch.randint(0, 160, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    batches = [ForwardBatch.build(ForwardMode.EXTEND, [prompt], [list(range(1, 71))])]
    batches += [ForwardBatch.build(ForwardMode.DECODE, [[5]], [list(range(1, 72 + i))]) for i in range(2)]
    for batch in batches:
        torch.testing.assert_close(quant.forward(batch), dense.forward(batch), atol=1e-4, rtol=1e-4)


def test_deterministic_inference_reaches_the_int8_projections(tmp_path):
    path = _tiny_checkpoint(tmp_path, "mistral")
    runner = ModelRunner(
        path, dtype="float32", device="cpu", max_total_tokens=64, torchao_config="int8wo", deterministic=True
    )
    assert all(m.batch_invariant for m in runner.model.modules() if isinstance(m, Int8Linear))


def test_bad_combinations_fail_before_loading(tmp_path):
    path = _tiny_checkpoint(tmp_path, "mistral")
    with pytest.raises(ValueError, match="choose one of"):
        ModelRunner(path, device="cpu", torchao_config="int3wo")
    gguf = tmp_path / "model.gguf"
    gguf.touch()  # never read: the flags are checked first
    with pytest.raises(ValueError, match="not with --quantization"):
        ModelRunner(str(gguf), device="cpu", quantization="gguf", torchao_config="int8wo")


def test_torchao_config_off_cpu_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    # Regression: on CUDA --torchao-config was refused only after the weights had loaded. No CUDA here: the runner
    # is handed a non-CPU device ("meta"), and any weight load fails the test.
    from radixserve.engine.model import runner as runner_module

    path = _tiny_checkpoint(tmp_path, "mistral")
    monkeypatch.setattr(runner_module, "resolve_device", lambda device: torch.device("meta"))
    monkeypatch.setattr(runner_module, "resolve_dtype", lambda dtype, device: torch.bfloat16)
    monkeypatch.setattr(runner_module, "load_weights", lambda *a: pytest.fail("weights loaded before the check"))
    with pytest.raises(ValueError, match="runs torch's CPU kernels: CPU with float32 / bfloat16 / float16 only"):
        ModelRunner(path, torchao_config="int8wo")


def test_the_engine_cli_lists_and_checks_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["engine", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--torchao-config" in text and "int4wo-128" in text
    ns = build_parser().parse_args(["engine", "--torchao-config", "int4wo-64"])
    assert engine_args_from_namespace(ns).torchao_config == "int4wo-64"
    with pytest.raises(SystemExit) as bad:
        build_parser().parse_args(["engine", "--torchao-config", "int4wo-7"])
    assert bad.value.code == 2 and "invalid choice: 'int4wo-7'" in capsys.readouterr().err
