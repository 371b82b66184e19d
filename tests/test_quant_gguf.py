"""GGUF weights kept quantized (engine/model/quant/): GGML blocks -> int4 kernel layout exactly, the packed kernel
against gguf-py's dequantize, the q/k row permutation against transformers', a tiny GGUF model against the
transformers-dequantized path, and one real tensor of the demo file."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from radixserve.engine.model.batch_invariant import row_invariance_violations
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.model.quant import int4_cpu
from radixserve.engine.model.quant import load as quant_load
from radixserve.engine.model.quant.affine import Int4Affine
from radixserve.engine.model.quant.embedding import GroupedEmbedding
from radixserve.engine.model.quant.ggml_blocks import split_q4_0, split_q4_1, split_q8_0
from radixserve.engine.model.quant.gguf_file import GGUFFile, GGUFTensor, UnsupportedGGUFType
from radixserve.engine.model.quant.int4_cpu import (
    DEQUANT_ROWS,
    compile_dequantize,
    dequantize,
    dequantize_codes,
    int4_linear,
    int4_mm,
    pack,
    unpack_codes,
)
from radixserve.engine.model.quant.linear import Int4Linear
from radixserve.engine.model.quant.rope_permute import reverse_rope_permutation
from radixserve.engine.model.runner import ModelRunner

from conftest import MODEL_DIR, demo_gguf, requires_demo_gguf, requires_model

TYPES = {
    "Q4_0": (QT.Q4_0, lambda raw: Int4Affine.from_q4_0(*split_q4_0(raw))),
    "Q4_1": (QT.Q4_1, lambda raw: Int4Affine.from_q4_1(*split_q4_1(raw))),
    "Q8_0": (QT.Q8_0, lambda raw: Int4Affine.from_q8_0(*split_q8_0(raw))),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _quantized(type_name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(raw GGML rows uint8 [n, bytes], gguf-py's dequantize of them float32 [n, k])`` of random weights."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(w, TYPES[type_name][0])
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, TYPES[type_name][0]))


@pytest.mark.parametrize("type_name", TYPES)
def test_blocks_become_the_gguf_weight_exactly(type_name):
    raw, ref = _quantized(type_name, 48, 96)
    w = TYPES[type_name][1](raw)
    assert (w.out_features, w.in_features) == (48, 96)
    assert torch.equal(w.dense(torch.float32), ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", TYPES)
def test_the_packed_kernel_gives_back_the_weight(type_name, dtype):
    """x = eye(K) through the kernel is W.T: bit-exact in float32 for Q4_0 / Q8_0, else within one rounding of the
    scale dtype (the scale and zero) plus one of the output."""
    raw, ref = _quantized(type_name, 64, 128, seed=1)
    w = TYPES[type_name][1](raw)
    p = pack(w, dtype)
    got = int4_mm(torch.eye(128, dtype=dtype), p.weight, p.scale_zeros, p.input_copies).T.float()
    if dtype == torch.float32 and type_name != "Q4_1":
        assert torch.equal(got, ref)
        return
    eps = torch.finfo(dtype).eps
    n = w.out_features
    group_mag = (w.codes.double() - 8).abs().view(n, -1, 32) * w.scale[..., None].abs() + w.zero[..., None].abs()
    bound = eps * (group_mag.view(n, w.input_copies, -1).sum(1) + ref.double().abs())
    assert ((got.double() - ref.double()).abs() <= bound).all()


@pytest.mark.parametrize("type_name", TYPES)
def test_an_int4_linear_is_x_times_the_dequantized_weight(type_name):
    raw, ref = _quantized(type_name, 96, 64, seed=2)
    lin = Int4Linear(64, 96)
    bias = torch.randn(96)
    lin.load(pack(TYPES[type_name][1](raw), torch.bfloat16), bias)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    got = lin(x.bfloat16()).float()
    want = x.bfloat16().float() @ ref.T + bias.bfloat16().float()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("type_name", TYPES)
def test_prefill_sized_calls_use_the_dequantized_weight(type_name):
    raw, ref = _quantized(type_name, 32, 64, seed=8)
    p = pack(TYPES[type_name][1](raw), torch.bfloat16)
    p32 = pack(TYPES[type_name][1](raw), torch.float32)
    w = dequantize(p32.weight, p32.scale_zeros, p32.input_copies)
    torch.testing.assert_close(w, ref, atol=1e-6, rtol=1e-6)  # float32 scale/zero: the weight to rounding
    x = torch.randn(DEQUANT_ROWS + 5, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    big, small = (
        int4_linear(x, p.weight, p.scale_zeros, p.input_copies),
        int4_mm(x, p.weight, p.scale_zeros, p.input_copies),
    )
    torch.testing.assert_close(big.float(), small.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(big, F.linear(x, dequantize(p.weight, p.scale_zeros, p.input_copies)))


def _random_affine(type_name: str, n: int, k: int, seed: int) -> Int4Affine:
    """Random codes with random fp16 scales (and Q4_1 mins) of ``type_name``, over the codes' whole range."""
    gen = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    if type_name == "Q8_0":
        return Int4Affine.from_q8_0(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), d)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    if type_name == "Q4_0":
        return Int4Affine.from_q4_0(codes, d)
    return Int4Affine.from_q4_1(codes, d, (torch.randn(n, k // 32, generator=gen) * 0.05).half())


# N: a tail block only (16, 48), full 64-row blocks (64, 192), both (112, 160); K with several groups
SHAPES = [(16, 64), (48, 96), (64, 32), (112, 64), (160, 128), (192, 64)]


@pytest.mark.parametrize("n, k", SHAPES)
def test_the_packed_bytes_give_back_the_codes(n, k):
    for seed, type_name in enumerate(TYPES):
        w = _random_affine(type_name, n, k, seed)
        assert torch.equal(unpack_codes(pack(w, torch.bfloat16).weight), w.codes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", TYPES)
def test_the_packed_dequantization_is_the_plain_codes_one_bit_for_bit(type_name, dtype):
    for i, (n, k) in enumerate(SHAPES):
        w = _random_affine(type_name, n, k, seed=10 + i)
        p = pack(w, dtype)
        got = dequantize(p.weight, p.scale_zeros, p.input_copies)
        assert got.dtype == dtype and tuple(got.shape) == (n, k)
        assert torch.equal(got, dequantize_codes(w.codes, p.scale_zeros, p.input_copies, dtype))


def test_int4_packed_holds_one_copy_of_the_codes():
    p = pack(_random_affine("Q4_1", 64, 128, seed=3), torch.bfloat16)
    assert p.nbytes() == 64 * 128 // 2 + (128 // 32) * 64 * 2 * 2  # codes + bfloat16 scale/zero pairs


def test_the_int4_kernel_is_batch_invariant():
    raw, _ = _quantized("Q4_1", 64, 96, seed=3)
    p = pack(TYPES["Q4_1"][1](raw), torch.bfloat16)
    x = torch.randn(70, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    fn = lambda rows: int4_mm(rows, p.weight, p.scale_zeros, 1)  # noqa: E731
    assert row_invariance_violations(fn, x, [1, 2, 3, 4, 5, 8, 9, 17, 33], offsets=[0, 1, 5]) == []


def test_a_batch_invariant_int4_linear_runs_the_kernel_at_every_size():
    raw, _ = _quantized("Q4_0", 32, 64, seed=9)
    lin = Int4Linear(64, 32)
    lin.load(pack(TYPES["Q4_0"][1](raw), torch.bfloat16))
    lin.batch_invariant = True
    x = torch.randn(DEQUANT_ROWS + 30, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert row_invariance_violations(lin, x, [1, 3, DEQUANT_ROWS, DEQUANT_ROWS + 1], offsets=[0, 7]) == []


def _transformers_reverse_permute(w: np.ndarray, n_head: int, n_kv_head: int) -> np.ndarray:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    return LlamaTensorProcessor()._reverse_permute_weights(w, n_head, n_kv_head)


def test_the_rope_row_order_is_transformers_reverse_permute():
    w = np.arange(96 * 3, dtype=np.float32).reshape(96, 3)
    for heads, kv in ((6, 6), (6, 2)):  # attn_q (n_head), attn_k (the kv heads)
        index = reverse_rope_permutation(96, kv)
        assert np.array_equal(w[index.numpy()], _transformers_reverse_permute(w, heads, kv))
    with pytest.raises(ValueError):
        reverse_rope_permutation(96, 5)


def test_permuted_and_fused_rows_stay_exact():
    raw_q, ref_q = _quantized("Q4_1", 64, 64, seed=4)
    raw_v, ref_v = _quantized("Q8_0", 32, 64, seed=5)
    index = reverse_rope_permutation(64, 4)
    q = TYPES["Q4_1"][1](raw_q).rows(index)
    fused = Int4Affine.cat([quant_load._with_copies(q, 2), TYPES["Q8_0"][1](raw_v)])
    want = torch.cat([torch.from_numpy(_transformers_reverse_permute(ref_q.numpy(), 4, 4)), ref_v])
    assert torch.equal(fused.dense(torch.float32), want)


@pytest.mark.parametrize("type_name", TYPES)
def test_embedding_rows_equal_gguf_dequantize(type_name):
    raw, ref = _quantized(type_name, 40, 64, seed=6)
    emb = GroupedEmbedding(40, 64, torch.bfloat16)
    if type_name == "Q8_0":
        q, d = split_q8_0(raw)
        emb.load(q, d.float(), None)
    elif type_name == "Q4_1":
        codes, d, m = split_q4_1(raw)
        emb.load(codes, d.float(), m.float())
    else:
        codes, d = split_q4_0(raw)
        emb.load(codes, d.float(), -8 * d.float())
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(emb(ids), ref[ids].bfloat16())


def test_an_unsupported_type_is_named():
    t = GGUFTensor("blk.0.attn_q.weight", "Q5_K", (64, 256), np.zeros((64, 176), np.uint8), QT.Q5_K)
    with pytest.raises(UnsupportedGGUFType, match=r"blk\.0\.attn_q\.weight: GGML type Q5_K"):
        quant_load.affine_from_gguf(t)


# ---- a tiny Llama GGUF, written here as llama.cpp would (q/k rows permuted), against transformers' dequantization

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 64, 4, 2, 128, 160


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: str, linear_type: str, embedding_type: str = "Q8_0") -> None:
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    head_dim = HIDDEN // HEADS

    def matrix(name: str, n: int, k: int, qtype: QT, permute_heads: int = 0) -> None:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
        if permute_heads:
            w = _llama_cpp_permute(w, permute_heads)
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.2 * rng.standard_normal(HIDDEN)).astype(np.float32))

    lin = TYPES[linear_type][0] if linear_type in TYPES else QT[linear_type]
    matrix("token_embd.weight", VOCAB, HIDDEN, QT[embedding_type])  # tied LM head, as SmolLM2's
    norm("output_norm.weight")
    for i in range(2):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN, lin, HEADS)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN, lin, KV_HEADS)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN, lin)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, lin)
        matrix(f"blk.{i}.ffn_gate.weight", INTER, HIDDEN, lin)
        matrix(f"blk.{i}.ffn_up.weight", INTER, HIDDEN, lin)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, INTER, lin)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("linear_type", ["Q4_1", "Q4_0"])
def test_a_tiny_gguf_model_kept_quantized_matches_the_dequantized_one(linear_type, tmp_path):
    path = str(tmp_path / f"tiny-{linear_type}.gguf")
    _write_tiny_gguf(path, linear_type)
    kw = dict(dtype="float32", device="cpu", max_total_tokens=64, weight_prepack=False)
    dense = ModelRunner(path, **kw)  # transformers' GGUF loader: dequantized, q/k un-permuted by transformers
    quant = ModelRunner(path, quantization="gguf", **kw)
    int4 = [m for m in quant.model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 2 * 4  # every projection; the Q8_0 LM head is dense (load.Q8_0_AS_INT4)
    assert isinstance(quant.model.model.embed_tokens, GroupedEmbedding)
    assert quant.weight_bytes() < dense.weight_bytes() / 2
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    batch = ForwardBatch.build(ForwardMode.EXTEND, [prompt], [list(range(1, 13))])
    torch.testing.assert_close(quant.forward(batch), dense.forward(batch), atol=1e-4, rtol=1e-4)


def _int4_modules(runner: ModelRunner) -> int:
    return sum(isinstance(m, Int4Linear) for m in runner.model.modules())


def test_a_gguf_stays_quantized_by_default_on_cpu_in_bfloat16(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(path, "Q4_1")
    kw = dict(device="cpu", max_total_tokens=64, weight_prepack=False)
    auto = ModelRunner(path, dtype="bfloat16", **kw)
    assert auto.quantization == "gguf" and _int4_modules(auto) == 2 * 4
    # asked dense, or float32 (the int4 kernel is a scalar loop there): dequantized
    for dense in (
        ModelRunner(path, dtype="bfloat16", quantization="none", **kw),
        ModelRunner(path, **kw | {"dtype": "float32"}),
    ):
        assert dense.quantization is None and _int4_modules(dense) == 0


def test_a_gguf_type_it_cannot_keep_is_dequantized_by_default_and_named(tmp_path, caplog):
    path = str(tmp_path / "tiny-q5.gguf")
    _write_tiny_gguf(path, "Q5_0")
    kw = dict(dtype="bfloat16", device="cpu", max_total_tokens=64, weight_prepack=False)
    with caplog.at_level(logging.WARNING, logger="radixserve.engine.model.runner"):
        auto = ModelRunner(path, **kw)
    assert auto.quantization is None and _int4_modules(auto) == 0
    assert "GGML type Q5_0" in caplog.text and "dequantized to bfloat16 instead" in caplog.text
    with pytest.raises(UnsupportedGGUFType, match=r"attn_q\.weight: GGML type Q5_0"):
        ModelRunner(path, quantization="gguf", **kw)
    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    batch = ForwardBatch.build(ForwardMode.EXTEND, [prompt], [list(range(1, 13))])
    dense = ModelRunner(path, quantization="none", **kw)
    assert torch.equal(auto.forward(batch), dense.forward(batch))  # the fallback is the plain dense load


def test_an_all_f16_gguf_loads_dense_and_reports_no_quantization(tmp_path):
    # Regression: a GGUF of F16 tensors only (nothing kept quantized) reported `quantization: gguf`.
    path = str(tmp_path / "tiny-f16.GGUF")  # and the extension in upper case (was "not a .gguf")
    _write_tiny_gguf(path, "F16", embedding_type="F16")
    runner = ModelRunner(path, dtype="bfloat16", device="cpu", max_total_tokens=64, weight_prepack=False)
    assert runner.quantization is None and _int4_modules(runner) == 0
    assert not isinstance(runner.model.model.embed_tokens, GroupedEmbedding)
    mixed = str(tmp_path / "tiny-f16-q8-embedding.gguf")
    _write_tiny_gguf(mixed, "F16")  # F16 projections, Q8_0 embedding kept as codes: that is quantized
    assert ModelRunner(mixed, dtype="bfloat16", device="cpu", max_total_tokens=64).quantization == "gguf"


def test_torchao_config_on_a_gguf_quantizes_its_dequantized_weights(tmp_path):
    from radixserve.engine.model.quant.int8_linear import Int8Linear

    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(path, "Q4_1")
    kw = dict(dtype="bfloat16", device="cpu", max_total_tokens=64, weight_prepack=False, torchao_config="int8wo")
    for quantization in (None, "none"):  # by default, and asked dense explicitly (was refused)
        runner = ModelRunner(path, quantization=quantization, **kw)
        assert runner.quantization == "int8wo" and _int4_modules(runner) == 0
        assert sum(isinstance(m, Int8Linear) for m in runner.model.modules()) == 2 * 4


def test_quantization_needs_a_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="needs a .gguf"):
        ModelRunner(str(tmp_path), quantization="gguf", device="cpu")


# ---- one real tensor of the demo file (read through the memory map, not a model load)


@requires_demo_gguf
def test_a_real_q4_1_tensor_packs_to_transformers_weight():
    f = GGUFFile(str(demo_gguf()))
    t = f.tensor("blk.0.attn_k.weight")  # Q4_1, [192, 576], rows permuted by llama.cpp (3 kv heads)
    assert (f.architecture, t.type_name, t.shape) == ("llama", "Q4_1", (192, 576))
    w = quant_load.affine_from_gguf(t).rows(reverse_rope_permutation(192, 3))
    want = torch.from_numpy(_transformers_reverse_permute(t.dequantize().numpy(), 9, 3))
    p = pack(w, torch.float32)
    got = int4_mm(torch.eye(576), p.weight, p.scale_zeros, 1).T
    assert torch.equal(w.dense(torch.float32), want)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dequantize(p.weight, p.scale_zeros, 1), want, atol=1e-6, rtol=1e-6)


@requires_demo_gguf
def test_real_tensors_dequantize_from_the_packed_bytes_bit_for_bit():
    """Each shape of the demo model's int4 projections (q/k/v and gate/up fused as the loader fuses them), from the
    packed bytes alone, equals the plain-codes dequantization, in bfloat16 and float32."""
    f = GGUFFile(str(demo_gguf()))
    parts = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up")}
    parts["down"] = ("ffn_down",)
    for names in parts.values():
        w = Int4Affine.cat([quant_load.affine_from_gguf(f.tensor(f"blk.3.{n}.weight")) for n in names])
        for dtype in (torch.bfloat16, torch.float32):
            p = pack(w, dtype)
            assert torch.equal(unpack_codes(p.weight), w.codes)
            assert torch.equal(
                dequantize(p.weight, p.scale_zeros, 1), dequantize_codes(w.codes, p.scale_zeros, 1, dtype)
            )


@pytest.mark.slow
@requires_model
@requires_demo_gguf
def test_the_demo_model_kept_quantized_gives_the_dequantized_models_logits():
    """The real model, quantized path vs the converted (transformers-dequantized) safetensors directory: float32
    logits equal to rounding, and bfloat16 greedy tokens the same."""
    prompt = [1, 504, 3458, 282, 4649, 314, 2, 28, 198, 17]
    kw = dict(device="cpu", max_total_tokens=64, num_threads=2)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [prompt], [list(range(1, 11))])
    logits = {}
    for name, path, extra in (("dense", MODEL_DIR, {}), ("quant", str(demo_gguf()), {"quantization": "gguf"})):
        logits[name] = ModelRunner(path, dtype="float32", **kw, **extra).forward(batch)
    torch.testing.assert_close(logits["quant"], logits["dense"], atol=2e-3, rtol=1e-3)
    tokens = {}
    for name, path, extra in (("dense", MODEL_DIR, {}), ("quant", str(demo_gguf()), {"quantization": "gguf"})):
        runner = ModelRunner(path, dtype="bfloat16", **kw, **extra)
        out = [int(runner.forward(batch).argmax(-1)[0])]
        for step in range(7):
            ctx = list(range(1, 12 + step))
            out.append(int(runner.forward(ForwardBatch.build(ForwardMode.DECODE, [[out[-1]]], [ctx])).argmax(-1)[0]))
        tokens[name] = out
    assert tokens["quant"] == tokens["dense"]


@pytest.mark.slow  # a few C++ compiles of seconds each
@pytest.mark.parametrize("type_name, dtype", [("Q4_1", torch.bfloat16), ("Q8_0", torch.float32)])
def test_the_compiled_dequantization_is_the_eager_one_bit_for_bit(type_name, dtype, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    p = pack(_random_affine(type_name, 112, 96, seed=5), dtype)  # a 64-row block and a 48-row tail
    fn = compile_dequantize(p.weight, p.scale_zeros, p.input_copies)
    got = fn(p.weight, *int4_cpu._split(p.scale_zeros)).T
    assert torch.equal(got, dequantize(p.weight, p.scale_zeros, p.input_copies))  # not prepared: the eager ops


@pytest.mark.slow  # a compile takes tens of seconds on 2 cores (as tests/test_compile.py)
def test_a_quantized_model_compiles_to_the_eager_logits(tmp_path, monkeypatch):
    """torch.compile traces the int4 custom op: one graph serves kernel-sized (decode) and dequantized (a prefill of
    DEQUANT_ROWS + 6 tokens) calls, with the eager logits; the dequantization compiled at load runs inside the
    compiled graph too (the eager ops are made to fail)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # the runner repoints it; restored after
    monkeypatch.setattr(int4_cpu, "COMPILE_MIN_CODES", 0)  # the tiny model's weights compile their dequantization
    path = str(tmp_path / "tiny.gguf")
    _write_tiny_gguf(path, "Q4_1")
    kw = dict(dtype="float32", device="cpu", max_total_tokens=128, quantization="gguf")
    eager = ModelRunner(path, torch_compile=False, **kw)
    compiled = ModelRunner(path, torch_compile=True, torch_compile_cache_dir=str(tmp_path / "cache"), **kw)

    def no_eager_dequantize(*args: object) -> torch.Tensor:
        raise AssertionError("dequantized by the eager ops, not the compiled ones")

    monkeypatch.setattr(int4_cpu, "_dequantize_t", no_eager_dequantize)
    prompt = torch.randint(0, VOCAB, (DEQUANT_ROWS + 6,), generator=torch.Generator().manual_seed(5)).tolist()
    n = len(prompt)
    batches = [ForwardBatch.build(ForwardMode.EXTEND, [prompt], [list(range(1, n + 1))])]
    batches += [ForwardBatch.build(ForwardMode.DECODE, [[7]], [list(range(1, n + 2 + i))]) for i in range(3)]
    for batch in batches:
        torch.testing.assert_close(compiled.forward(batch), eager.forward(batch), atol=1e-4, rtol=1e-4)
