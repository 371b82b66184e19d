"""Our Llama-family forward vs HF transformers: greedy parity, prefix/batch consistency, GGUF, other architectures."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.engine.model.config import ModelConfig
from radixserve.engine.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.engine.model.rope import rope_inv_freq
from radixserve.engine.model.runner import ModelRunner, resolve_dtype

from conftest import MODEL_DIR, demo_gguf, requires_demo_gguf, requires_model

POOL_TOKENS = 2048


def _scattered_slots(n: int, seed: int, taken: set[int] | None = None) -> list[int]:
    """n distinct, shuffled, non-contiguous slots in 1..POOL_TOKENS."""
    taken = taken if taken is not None else set()
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        s = rng.randrange(1, POOL_TOKENS + 1)
        if s not in taken:
            taken.add(s)
            out.append(s)
    return out


def _greedy(runner: ModelRunner, prompt: list[int], n_new: int, slots: list[int], eos: set[int]) -> list[int]:
    """Test-local generation loop: prefill the prompt into ``slots``, then decode one token at a time."""
    assert len(slots) >= len(prompt) + n_new
    n = len(prompt)
    logits = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [prompt], [slots[:n]]))
    out: list[int] = []
    while True:
        tok = int(logits[0].argmax())
        out.append(tok)
        if tok in eos or len(out) == n_new:
            return out
        ctx = slots[: n + len(out)]
        logits = runner.forward(ForwardBatch.build(ForwardMode.DECODE, [[tok]], [ctx]))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: on the shared 2-core machine two threads collapse under others' load (one decode step
    went from 95 ms to 3.7 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    """The real demo model: tests using it are marked slow."""
    return ModelRunner(MODEL_DIR, dtype="float32", device="cpu", max_total_tokens=POOL_TOKENS)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@requires_model
@pytest.mark.slow
def test_greedy_matches_hf_generate(runner, tokenizer):
    from transformers import AutoModelForCausalLM

    msgs = [{"role": "user", "content": "Write a detailed story about a lighthouse keeper who finds a map."}]
    enc = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = enc["input_ids"][0].tolist()
    hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    with torch.inference_mode():
        ref = hf.generate(enc["input_ids"], attention_mask=enc["attention_mask"], do_sample=False, max_new_tokens=64)[
            0, len(prompt) :
        ].tolist()
    assert len(ref) >= 64, "the reference stopped early; choose a prompt with a longer answer"
    ours = _greedy(
        runner,
        prompt,
        len(ref),
        _scattered_slots(len(prompt) + len(ref), seed=1),
        set(runner.model_config.eos_token_ids),
    )
    assert ours == ref


@requires_model
@pytest.mark.slow
def test_model_config_and_defaults(runner):
    cfg = runner.model_config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2] and cfg.context_length == 8192
    assert runner.kv_pool.size == POOL_TOKENS + 1 and runner.max_total_tokens == POOL_TOKENS
    assert runner.kv_pool.bytes_per_token() == 2 * 30 * 3 * 64 * 4


@requires_model
def test_a_test_not_marked_slow_cannot_load_the_real_model():
    """tests/conftest.py's guard: `make test-fast` must not load the demo weights, so this (unmarked) test may not."""
    from radixserve.engine.model import loader

    with pytest.raises(RuntimeError, match="not marked slow"):
        loader.iter_safetensors(MODEL_DIR)
    if demo_gguf() is not None:
        with pytest.raises(RuntimeError, match="not marked slow"):
            loader.iter_gguf(demo_gguf())


def test_resolve_dtype():
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError):
        resolve_dtype("int3", torch.device("cpu"))


@requires_model
@pytest.mark.slow
def test_prefix_extend_matches_single_prefill(runner):
    """prefill [A+B] in one EXTEND == prefill A, then EXTEND B over A's (scattered) slots."""
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (37,)).tolist()
    a, b = ids[:23], ids[23:]
    taken: set[int] = set()
    s_full = _scattered_slots(len(ids), seed=2, taken=taken)
    s_split = _scattered_slots(len(ids), seed=3, taken=taken)
    full = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [ids], [s_full]))
    first = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [a], [s_split[: len(a)]]))
    second = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [b], [s_split]))
    torch.testing.assert_close(second, full, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(first, full, atol=1e-2)  # A's last-token logits differ: the comparison has teeth

    # a mixed EXTEND batch (one with a prefix, one without) equals each run alone
    s_new = _scattered_slots(9, seed=4, taken=taken)
    c = ids[5:14]
    alone_c = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [c], [s_new]))
    s_ext = s_split + _scattered_slots(4, seed=5, taken=taken)
    d = ids[:4]
    alone_d = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [d], [s_ext]))
    both = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [c, d], [s_new, s_ext]))
    torch.testing.assert_close(both, torch.cat([alone_c, alone_d]), atol=2e-4, rtol=1e-4)


@requires_model
@pytest.mark.slow
def test_batched_decode_matches_individual(runner):
    """Several sequences of different lengths decoded in one batch == each decoded alone."""
    torch.manual_seed(1)
    taken: set[int] = set()
    seqs, slots = [], []
    for i, n in enumerate([5, 19, 11, 2]):
        ids = torch.randint(100, 40000, (n,)).tolist()
        s = _scattered_slots(n + 1, seed=10 + i, taken=taken)
        runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [ids], [s[:n]]))
        seqs.append(ids)
        slots.append(s)
    next_tok = [[int(t)] for t in torch.randint(100, 40000, (4,))]
    batched = runner.forward(ForwardBatch.build(ForwardMode.DECODE, next_tok, slots))
    alone = torch.cat(
        [runner.forward(ForwardBatch.build(ForwardMode.DECODE, [t], [s])) for t, s in zip(next_tok, slots)]
    )
    assert batched.shape == (4, runner.model_config.vocab_size) and batched.dtype == torch.float32
    torch.testing.assert_close(batched, alone, atol=2e-4, rtol=1e-4)
    # and equals the last row of a fresh full prefill of the same sequence
    fresh_slots = _scattered_slots(20, seed=99, taken=taken)
    full = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [seqs[1] + next_tok[1]], [fresh_slots]))
    torch.testing.assert_close(batched[1:2], full, atol=2e-4, rtol=1e-4)


@requires_model
@pytest.mark.slow
@requires_demo_gguf
def test_gguf_loads_same_as_safetensors(runner):
    gguf = ModelRunner(demo_gguf(), dtype="float32", device="cpu", max_total_tokens=256)
    assert gguf.model_config.num_layers == 30 and gguf.model_config.num_kv_heads == 3
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2]
    a = _greedy(gguf, prompt, 6, list(range(1, 20)), set())
    b = _greedy(runner, prompt, 6, _scattered_slots(20, seed=7), set())
    assert a == b


# --- tiny random checkpoints of each supported architecture, compared with transformers' own model --------------


def _tiny_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    return {
        "llama-llama3-rope": LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=50000.0,
        ),
        "qwen2-bias-yarn": Qwen2Config(
            **common,
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        ),
        "mistral": MistralConfig(**common, tie_word_embeddings=False, sliding_window=None),
        "qwen3-qknorm-linear": Qwen3Config(
            **common, head_dim=16, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}
        ),
    }


@pytest.mark.parametrize("name", ["llama-llama3-rope", "qwen2-bias-yarn", "mistral", "qwen3-qknorm-linear"])
def test_tiny_hf_checkpoint_matches_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _tiny_configs()[name]
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random biases / norm weights, so a dropped bias or norm would show
        for n, p in hf.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.normal_(0, 0.5 if n.endswith("bias") else 0.2).add_(1.0 if "norm" in n else 0.0)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = ModelRunner(str(tmp_path), dtype="float32", device="cpu", max_total_tokens=POOL_TOKENS)
    if name.startswith("qwen2"):  # the bias lives in the prepacked GEMM; a dropped one fails the logits below
        assert ours.model_config.attention_bias
    ids = torch.randint(0, 160, (1, 140))  # past original_max_position_embeddings, so rope scaling matters
    with torch.inference_mode():
        ref = hf(ids).logits[0].float()  # [140, vocab]
    slots = _scattered_slots(140, seed=3)
    got_prefill = ours.forward(ForwardBatch.build(ForwardMode.EXTEND, [ids[0, :120].tolist()], [slots[:120]]))
    torch.testing.assert_close(got_prefill[0], ref[119], atol=1e-4, rtol=1e-4)
    for t in range(120, 140):  # decode the rest one token at a time
        got = ours.forward(ForwardBatch.build(ForwardMode.DECODE, [[int(ids[0, t])]], [slots[: t + 1]]))
        torch.testing.assert_close(got[0], ref[t], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama-llama3-rope", "qwen2-bias-yarn", "qwen3-qknorm-linear"])
def test_rope_frequencies_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = _tiny_configs()[name]
    cfg = ModelConfig.from_hf_config(hf_cfg)
    inv, scale = rope_inv_freq(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.context_length, cfg.max_position_embeddings
    )
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[cfg.rope_type](hf_cfg, "cpu")
    torch.testing.assert_close(inv, ref_inv.float())
    assert scale == pytest.approx(ref_scale)


def test_unsupported_architecture_rejected():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf_config(GPT2Config())


def test_config_reads_rope_and_generation_eos(tmp_path):
    """Old-style ``rope_scaling`` + ``rope_theta`` fields, and EOS ids merged from generation_config.json."""
    import json

    cfg = _tiny_configs()["mistral"].to_dict()
    cfg.pop("rope_parameters", None)
    cfg.update(
        architectures=["MistralForCausalLM"],
        eos_token_id=2,
        rope_theta=123.0,
        rope_scaling={"type": "linear", "factor": 3.0},
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 77]}))
    mc = ModelConfig.from_pretrained(str(tmp_path), context_length=1000)
    assert mc.eos_token_ids == [2, 77] and mc.context_length == 1000 and mc.max_position_embeddings == 256
    assert mc.rope_theta == 123.0 and mc.rope_type == "linear" and mc.rope_scaling["factor"] == 3.0
