"""KV pool sizing: ``--mem-fraction-static`` (SGLang's meaning), the CPU default within the memory limit, the cgroup
limit read from /proc and /sys, and ``radixserve up`` giving each engine a share that fits the machine.

Regression (issue 11, item 8): ``make run`` took ~6.5 GB for a 135M model (each engine's KV pool was a fixed 2 GiB
whatever the machine), and there was no ``--mem-fraction-static``. No real model is loaded here: the runner and
engine tests use a tiny random checkpoint (tests/tiny_model.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from radixserve.engine.config import EngineArgs, validate_engine_args
from radixserve.engine.memory import sizing
from radixserve.engine.memory.sizing import GiB, cgroup_memory_limit_bytes, memory_limit_bytes, size_kv_pool
from radixserve.launch import local_stack
from radixserve.launch.cli import main
from radixserve.launch.local_stack import (
    ENGINE_RUNTIME_BYTES,
    ROUTER_RESERVE_BYTES,
    engine_argv,
    engine_mem_fraction,
    size_engines,
)

from tiny_model import write_tiny_model

MiB = 2**20
# The demo model (SmolLM2-135M): 30 layers x 3 KV heads x 64 dims; bf16 weights in memory, fp32 on disk.
DEMO_BF16_PER_TOKEN = 2 * 30 * 3 * 64 * 2
DEMO_FP32_PER_TOKEN = 2 * DEMO_BF16_PER_TOKEN
DEMO_BF16_WEIGHTS = 270 * MiB
DEMO_DISK_WEIGHTS = 538_090_408  # models/smollm2-135m-instruct/model.safetensors


def cpu(memory: int, used: int = DEMO_BF16_WEIGHTS, per_token: int = DEMO_BF16_PER_TOKEN, **flags):
    return size_kv_pool(
        bytes_per_token=per_token,
        context_length=8192,
        device_type="cpu",
        memory_bytes=memory,
        used_bytes=used,
        **flags,
    )


# ----------------------------------------------------------------------------------------------- the engine's rule


def test_cpu_default_on_a_big_machine_is_todays_2_gib_pool():
    pool = cpu(24 * GiB)
    assert pool.tokens == 2 * GiB // DEMO_BF16_PER_TOKEN
    assert "default" in pool.rule
    # a model with tiny KV rows stops at 200k tokens
    assert cpu(24 * GiB, per_token=1024).tokens == sizing.CPU_MAX_TOTAL_TOKENS


def test_cpu_default_in_a_3_gib_cgroup_stays_within_the_limit():
    # The case: a 3 GiB container must not get a 2 GiB pool on top of the weights and the runtime.
    for per_token, weights in ((DEMO_BF16_PER_TOKEN, DEMO_BF16_WEIGHTS), (DEMO_FP32_PER_TOKEN, DEMO_DISK_WEIGHTS)):
        pool = cpu(3 * GiB, used=weights, per_token=per_token)
        pool_bytes = pool.tokens * per_token
        assert pool_bytes < 2 * GiB
        assert weights + pool_bytes <= sizing.CPU_DEFAULT_MEM_FRACTION * 3 * GiB
        assert weights + pool_bytes + ENGINE_RUNTIME_BYTES < 3 * GiB
        assert pool.tokens >= 8192  # still one full context


def test_cpu_default_for_a_long_context_model_on_a_big_machine_starts_as_before():
    # 2 GiB of a 128 KiB/token model is 16384 tokens, less than its 131072-token context: served with the context
    # cut to the pool, as before (only the memory limit cutting the pool below one context is an error).
    pool = size_kv_pool(
        bytes_per_token=128 * 1024,
        context_length=131072,
        device_type="cpu",
        memory_bytes=64 * GiB,
        used_bytes=16 * GiB,
    )
    assert pool.tokens == 16384


def test_mem_fraction_static_is_fraction_of_memory_minus_weights():
    pool = cpu(8 * GiB, mem_fraction_static=0.5)
    assert pool.tokens == (4 * GiB - DEMO_BF16_WEIGHTS) // DEMO_BF16_PER_TOKEN  # no 2 GiB / 200k cap: the user's
    assert pool.rule.startswith("--mem-fraction-static 0.5")


def test_cuda_default_is_sglangs_0_9_of_total_minus_memory_in_use():
    pool = size_kv_pool(
        bytes_per_token=DEMO_BF16_PER_TOKEN,
        context_length=8192,
        device_type="cuda",
        memory_bytes=80 * GiB,
        used_bytes=2 * GiB,
    )
    assert pool.tokens == (int(0.9 * 80 * GiB) - 2 * GiB) // DEMO_BF16_PER_TOKEN
    assert "0.9" in pool.rule and "GPU" in pool.rule


def test_max_total_tokens_wins_and_the_log_says_so():
    pool = cpu(8 * GiB, max_total_tokens=5000, mem_fraction_static=0.5)
    assert pool.tokens == 5000
    assert pool.rule == "--max-total-tokens 5000 (wins over --mem-fraction-static 0.5)"


def test_a_fraction_too_small_for_weights_plus_one_context_is_an_error_naming_the_flag():
    with pytest.raises(ValueError, match=r"KV pool too small: --mem-fraction-static 0.05: .*one context \(8192 tokens"):
        cpu(8 * GiB, mem_fraction_static=0.05)  # 410 MiB - 270 MiB of weights < 180 MiB of one context
    with pytest.raises(ValueError, match="KV pool too small: the default on CPU"):
        cpu(512 * MiB)  # the default on a tiny machine: the same clear error, not an OOM kill later


# --------------------------------------------------------------------------------------------- the memory limit


def _fake_system(tmp: Path, cgroup_lines: str, files: dict[str, str], mem_total_kb: int = 24 * 1024 * 1024):
    proc, cg = tmp / "proc", tmp / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    (proc / "meminfo").write_text(f"MemTotal:       {mem_total_kb} kB\nMemFree:        1000 kB\n")
    for rel, text in files.items():
        (cg / rel).parent.mkdir(parents=True, exist_ok=True)
        (cg / rel).write_text(text)
    return str(proc), str(cg)


def test_memory_limit_cgroup_v2(tmp_path):
    proc, cg = _fake_system(tmp_path, "0::/\n", {"memory.max": f"{3 * GiB}\n"})
    assert memory_limit_bytes(proc, cg) == 3 * GiB


def test_memory_limit_cgroup_v2_nested_group_and_its_parent(tmp_path):
    files = {"a/b/memory.max": "max\n", "a/memory.max": f"{4 * GiB}\n"}
    proc, cg = _fake_system(tmp_path, "0::/a/b\n", files)
    assert cgroup_memory_limit_bytes(proc, cg) == 4 * GiB  # the parent's limit binds the child


def test_memory_limit_cgroup_v1_and_unlimited(tmp_path):
    lines = "5:cpu,cpuacct:/x\n4:memory:/pod/c\n0::/\n"
    proc, cg = _fake_system(tmp_path, lines, {"memory/pod/c/memory.limit_in_bytes": f"{2 * GiB}\n"})
    assert memory_limit_bytes(proc, cg) == 2 * GiB
    unlimited = {"memory/memory.limit_in_bytes": "9223372036854771712\n"}
    proc, cg = _fake_system(tmp_path / "u", "4:memory:/\n", unlimited, mem_total_kb=8 * 1024 * 1024)
    assert memory_limit_bytes(proc, cg) == 8 * GiB  # no real limit: MemTotal


def test_memory_limit_without_cgroup_is_mem_total(tmp_path):
    proc, cg = _fake_system(tmp_path, "0::/\n", {}, mem_total_kb=16 * 1024 * 1024)
    assert memory_limit_bytes(proc, cg) == 16 * GiB
    assert memory_limit_bytes() > 0  # this machine's


# ------------------------------------------------------------------------------------------------------ the flag


@pytest.mark.parametrize("value", ["0", "1", "1.5", "-0.2", "nan"])
def test_mem_fraction_static_outside_0_1_exits_2_naming_the_flag(value, capsys):
    assert main(["engine", "--mem-fraction-static", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixserve engine: --mem-fraction-static must be between 0 and 1") and value in err


def test_mem_fraction_static_not_a_number_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["engine", "--mem-fraction-static", "lots"])
    assert e.value.code == 2 and "--mem-fraction-static" in capsys.readouterr().err


def test_mem_fraction_static_parses_and_validates():
    validate_engine_args(EngineArgs(mem_fraction_static=0.3))


# ------------------------------------------------------------------------------------------ the runner, start-up


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def test_runner_sizes_its_pool_within_the_memory_limit(tiny_model, monkeypatch, caplog):
    from radixserve.engine.model import runner as runner_mod

    monkeypatch.setattr(runner_mod, "memory_limit_bytes", lambda: 64 * MiB)
    with caplog.at_level(logging.INFO, logger="radixserve.engine.model.runner"):
        r = runner_mod.ModelRunner(tiny_model, dtype="float32", device="cpu")
    weights = r.weight_bytes()
    assert 10 * MiB < weights < 20 * MiB  # ~13 MB of fp32 parameters (float32 is not prepacked)
    per_token = r.kv_pool.bytes_per_token()
    assert r.max_total_tokens == (int(0.6 * 64 * MiB) - weights) // per_token  # not 2 GiB / 200k tokens
    # One line: the pool's size, its tokens, and the rule that sized it (regression: "... within 0.6 x 23.5 GiB of
    # the memory limit - 259 MiB of weights = 13.9 GiB" read as a 13.9 GiB pool).
    rule = "the default on CPU: at most 2.0 GiB and 200,000 tokens, with weights + pool within 60% of the 64 MiB"
    assert f"KV pool: {sizing.format_bytes(r.kv_pool.total_bytes())}, {r.max_total_tokens:,} tokens" in caplog.text
    assert f"tokens at 512 B/token; sized by {rule} memory limit ({sizing.format_bytes(weights)} of wei" in caplog.text
    r = runner_mod.ModelRunner(tiny_model, dtype="float32", device="cpu", mem_fraction_static=0.5)
    assert r.max_total_tokens == (32 * MiB - weights) // per_token
    r = runner_mod.ModelRunner(
        tiny_model, dtype="float32", device="cpu", max_total_tokens=3000, mem_fraction_static=0.5
    )
    assert r.max_total_tokens == 3000


def test_start_up_line_prints_weight_pool_and_resident_bytes(tiny_model, caplog):
    from radixserve.engine.model.runner import ModelRunner

    r = ModelRunner(tiny_model, dtype="float32", device="cpu", max_total_tokens=64, torch_compile=False)
    with caplog.at_level(logging.INFO, logger="radixserve.engine.model.runner"):
        r.warmup()
    line = next(m for m in caplog.messages if m.startswith("start-up: load"))
    want = f"weights {sizing.format_bytes(r.weight_bytes())}, KV pool {sizing.format_bytes(r.kv_pool.total_bytes())}"
    assert want in line
    rss = sizing.process_rss_bytes()
    assert rss is not None and rss > r.weight_bytes() and ", RSS " in line


def test_process_rss_reads_vmrss_and_is_none_without_proc(tmp_path):
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "status").write_text("Name:\tpython\nVmRSS:\t  123456 kB\n")
    assert sizing.process_rss_bytes(str(tmp_path)) == 123456 * 1024
    assert sizing.process_rss_bytes(str(tmp_path / "missing")) is None


def test_engine_whose_fraction_cannot_hold_a_context_exits_non_zero_with_one_line(tiny_model, capsys):
    flags = ["--mem-fraction-static", "0.0000001", "--device", "cpu", "--port", "0"]
    status = main(["engine", "--model-path", tiny_model, *flags])
    assert status != 0
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("radixserve engine: KV pool too small: --mem-fraction-static 1e-07")
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------- radixserve up


@pytest.mark.parametrize(
    "memory, expected",
    [
        # 4 GiB, 2 engines: each gets (4 GiB - router - 2 runtimes) / 2 = 1 GiB for weights + pool.
        (4 * GiB, 0.25),
        # 8 GiB and 24 GiB: today's 2 GiB default per engine fits; the engines keep it.
        (8 * GiB, None),
        (24 * GiB, None),
    ],
)
def test_up_engine_share_for_two_demo_engines(memory, expected):
    fraction = engine_mem_fraction(memory, 2, DEMO_DISK_WEIGHTS)
    assert fraction == expected
    if fraction is not None:
        # what the two engines then hold, with their runtimes and the router, fits the machine
        per_engine = fraction * memory  # weights + pool, as the engine computes it
        assert 2 * (per_engine + ENGINE_RUNTIME_BYTES) + ROUTER_RESERVE_BYTES <= memory
        pool = cpu(memory, mem_fraction_static=fraction)  # bf16 weights in memory: a full context fits
        assert pool.tokens >= 8192


def test_up_engine_share_shrinks_with_more_engines_and_refuses_what_cannot_fit():
    share = (8 * GiB - ROUTER_RESERVE_BYTES - 4 * ENGINE_RUNTIME_BYTES) / 4  # 1.19 GiB each
    assert engine_mem_fraction(8 * GiB, 4, DEMO_DISK_WEIGHTS) == pytest.approx(share / (8 * GiB), abs=1e-3)
    with pytest.raises(ValueError, match="too small for 4 engine"):
        engine_mem_fraction(4 * GiB, 4, DEMO_DISK_WEIGHTS)


def test_up_passes_the_share_on_each_engines_command_line(monkeypatch):
    monkeypatch.setattr(local_stack, "_engines_run_on_cpu", lambda device: True)
    monkeypatch.setattr(local_stack, "model_weight_bytes", lambda path: DEMO_DISK_WEIGHTS)
    sized = size_engines(EngineArgs(), 2, memory_limit_bytes=4 * GiB)
    argv = engine_argv(sized, 30000, 1)
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.25"
    assert "--mem-fraction-static" not in engine_argv(size_engines(EngineArgs(), 2, 24 * GiB), 30000, 1)


def test_up_respects_the_users_flags(monkeypatch):
    monkeypatch.setattr(local_stack, "_engines_run_on_cpu", lambda device: True)
    explicit = EngineArgs(max_total_tokens=4096)
    assert size_engines(explicit, 2, memory_limit_bytes=4 * GiB) is explicit
    per_engine = EngineArgs(mem_fraction_static=0.3)  # each engine's share, as for SGLang servers on one device
    assert size_engines(per_engine, 2, memory_limit_bytes=4 * GiB).mem_fraction_static == 0.3
    with pytest.raises(ValueError, match=r"--mem-fraction-static 0.6 is each engine's share .* take 1.2"):
        size_engines(EngineArgs(mem_fraction_static=0.6), 2, memory_limit_bytes=4 * GiB)


def test_up_leaves_gpu_engines_to_their_own_sizing():
    assert size_engines(EngineArgs(device="cuda"), 2, memory_limit_bytes=4 * GiB).mem_fraction_static is None


def test_model_weight_bytes_counts_the_weight_files(tmp_path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 50)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 1000)
    assert local_stack.model_weight_bytes(str(tmp_path)) == 150
    (tmp_path / "m.gguf").write_bytes(b"x" * 70)
    assert local_stack.model_weight_bytes(str(tmp_path / "m.gguf")) == 70


@pytest.mark.skipif(sizing.process_rss_bytes() is None, reason="no /proc/self/status")
def test_freed_heap_memory_goes_back_to_the_os():
    """The pattern of a load: many heap blocks freed between ones still alive stay resident until trimmed."""
    blocks = [bytearray(b"x" * 65536) for _ in range(3000)]  # 192 MiB of blocks below glibc's mmap threshold
    alive = blocks[::10]
    del blocks
    before = sizing.process_rss_bytes()
    assert sizing.release_freed_memory()
    after = sizing.process_rss_bytes()
    assert before is not None and after is not None
    assert before - after > 100 * 2**20, (before, after)
    assert len(alive) == 300
