"""``--model-path`` / ``--tokenizer-path`` checks (engine/model/locate.py): one clear line before anything loads, and
never a hub lookup; ``radixserve engine`` and ``radixserve up`` exit 2 with it at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixserve.engine.model.locate import ModelPathError, check_model_path, check_model_paths, check_tokenizer_path

from conftest import MODEL_DIR, ROOT, free_port, requires_model, write_gguf


def model_dir(root: Path, *files: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for f in files:
        (root / f).write_bytes(b"{}")
    return root


def test_a_missing_path_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match="no such file or directory") as e:
        check_model_path(str(tmp_path / "nope"))
    assert "\n" not in str(e.value) and "hub id" not in str(e.value)
    assert isinstance(e.value, ValueError)  # what the CLI turns into `radixserve engine: ...` and exit 2


def test_a_missing_path_under_an_existing_directory_is_a_local_typo_not_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ModelPathError) as e:
        check_model_path("models/smolm2")
    assert "hub id" not in str(e.value)


def test_a_hub_id_says_to_download_it_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(ModelPathError) as e:
        check_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert time.monotonic() - t0 < 1  # no hub lookup
    msg = str(e.value)
    assert "\n" not in msg and "looks like a Hugging Face hub id" in msg
    assert "hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir models/SmolLM2-135M-Instruct" in msg
    assert msg.endswith("--model-path models/SmolLM2-135M-Instruct")


def test_an_empty_directory_has_no_config(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match="no config.json"):
        check_model_path(str(model_dir(tmp_path / "m")))


def test_a_directory_with_config_but_no_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelPathError, match=r"no \*\.safetensors weights in this directory \("):
        check_model_path(str(model_dir(tmp_path / "m", "config.json")))
    with pytest.raises(ModelPathError, match="found pytorch_model.bin, but only safetensors"):
        check_model_path(str(model_dir(tmp_path / "m", "config.json", "pytorch_model.bin")))


def test_a_directory_with_config_and_weights_passes(tmp_path: Path) -> None:
    check_model_path(str(model_dir(tmp_path / "one", "config.json", "model.safetensors")))
    check_model_path(str(model_dir(tmp_path / "sharded", "config.json", "model.safetensors.index.json")))


def test_gguf_paths(tmp_path: Path) -> None:
    good = write_gguf(tmp_path / "m.Q4_K_M.gguf")
    check_model_path(str(good))
    check_tokenizer_path(str(good))
    pointer = tmp_path / "lfs.gguf"
    pointer.write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ModelPathError, match="not a GGUF file"):
        check_model_path(str(pointer))
    with pytest.raises(ModelPathError, match="a file, but not a .gguf"):
        check_model_path(str(model_dir(tmp_path / "d", "weights.bin") / "weights.bin"))
    only = tmp_path / "only"
    only.mkdir()
    write_gguf(only / "m.gguf")
    with pytest.raises(ModelPathError, match="pass the file itself"):
        check_model_path(str(only))  # a directory holding only the .gguf


def test_a_truncated_gguf_is_one_clear_line(tmp_path: Path) -> None:
    # Regression: a cut-off download failed deep in the loader with "cannot reshape array of size 399424 into shape
    # (576,960)" (tensor data cut) or a bare struct.error (header cut).
    from radixserve.engine.model.gguf_header import read_gguf_header

    full = write_gguf(tmp_path / "full.gguf")
    data, needed = full.read_bytes(), read_gguf_header(str(full)).needed_bytes
    assert needed <= len(data)  # the writer pads the last tensor to the alignment
    for keep, reason in [(needed - 1, "truncated: its 2 tensors need"), (40, "truncated header")]:
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        for check in (check_model_path, check_tokenizer_path):
            with pytest.raises(ModelPathError, match=reason) as e:
                check(str(cut))
            assert "\n" not in str(e.value) and "not a complete GGUF file" in str(e.value)


def test_gguf_extension_in_any_case_and_every_file_of_a_directory_named(tmp_path: Path) -> None:
    # Regression: `model.GGUF` was "a file, but not a .gguf", and a directory of two GGUF files named only one.
    upper = write_gguf(tmp_path / "model.GGUF")
    check_model_path(str(upper))
    check_tokenizer_path(str(upper))
    two = tmp_path / "two"
    two.mkdir()
    write_gguf(two / "a.Q4_0.gguf")
    write_gguf(two / "b.Q8_0.gguf")
    with pytest.raises(ModelPathError, match="2 GGUF files; pass one of them") as e:
        check_model_path(str(two))
    assert "a.Q4_0.gguf" in str(e.value) and "b.Q8_0.gguf" in str(e.value)


def test_tokenizer_path_is_checked_when_given(tmp_path: Path) -> None:
    weights = str(model_dir(tmp_path / "m", "config.json", "model.safetensors"))
    check_model_paths(weights)  # no tokenizer path: the model directory's tokenizer (not checked here)
    with pytest.raises(ModelPathError, match="--tokenizer-path .*: no tokenizer in this directory"):
        check_model_paths(weights, str(model_dir(tmp_path / "t")))
    with pytest.raises(ModelPathError, match="--tokenizer-path .*: no such file or directory"):
        check_model_paths(weights, str(tmp_path / "nope"))
    check_model_paths(weights, str(model_dir(tmp_path / "t2", "tokenizer.json")))


@requires_model
def test_the_demo_model_passes() -> None:
    check_model_paths(MODEL_DIR)
    check_tokenizer_path(MODEL_DIR)


@pytest.mark.parametrize("command", ["engine", "up"])
@pytest.mark.parametrize("path", ["/nonexistent", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_a_bad_model_path_exits_2_at_once_with_one_line(command: str, path: str, tmp_path: Path) -> None:
    # Regression: a traceback ending "Repo id must be in the form 'repo_name'...", a ~50 s hub hang, and `up`
    # restarting its engines forever behind a router answering 503.
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve", command, "--model-path", path],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"radixserve {command}: --model-path {path}: "), proc.stderr


@pytest.mark.slow  # ~15 s: three engine processes start (torch imports) and fail
def test_up_stops_after_an_engine_failed_to_start_three_times(tmp_path: Path) -> None:
    # A model directory that passes the path check but cannot load: the stack ends with one line and status 1
    # instead of restarting the engine forever behind a router answering 503.
    bad = model_dir(tmp_path / "bad", "config.json", "model.safetensors")
    port, engine_port = free_port(), free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve", "up", "--engines", "1", "--model-path", str(bad)]
        + ["--port", str(port), "--engine-base-port", str(engine_port)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "radixserve up: engine 0 failed to start 3 times in a row; last exit status 2; see its output above"
    assert proc.stderr.count("engine 0 started") == 3
