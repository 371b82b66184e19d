"""Engine flags: ``--api-key`` from ``RADIXSERVE_API_KEY`` (a key stays off command lines, which ``ps`` shows to every
user), ``--dtype`` naming float16, the new logging flag. Regression (issue 11, items 7 and 11)."""

from __future__ import annotations

import pytest

from radixserve.engine.config import API_KEY_ENV, EngineArgs, engine_args_from_namespace
from radixserve.launch.cli import build_parser, main


@pytest.mark.parametrize("command", ["engine", "up"])
def test_api_key_defaults_from_the_environment_and_the_flag_wins(command, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "s3cret-from-env")
    assert engine_args_from_namespace(build_parser().parse_args([command])).api_key == "s3cret-from-env"
    ns = build_parser().parse_args([command, "--api-key", "from-flag"])
    assert engine_args_from_namespace(ns).api_key == "from-flag"
    monkeypatch.setenv(API_KEY_ENV, "")  # set but empty: no key, not the empty key
    assert build_parser().parse_args([command]).api_key is None
    monkeypatch.delenv(API_KEY_ENV)
    assert build_parser().parse_args([command]).api_key is None


def test_help_names_the_variable_and_never_prints_the_key(monkeypatch, capsys):
    monkeypatch.setenv(API_KEY_ENV, "s3cret-from-env")
    with pytest.raises(SystemExit):
        main(["engine", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert API_KEY_ENV in text
    assert "s3cret-from-env" not in text


def test_dtype_help_lists_float16(capsys):
    with pytest.raises(SystemExit):
        main(["engine", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "float32, bfloat16 or float16" in text
    assert build_parser().parse_args(["engine", "--dtype", "float16"]).dtype == "float16"


def test_decode_log_interval_flag(capsys):
    assert build_parser().parse_args(["engine"]).decode_log_interval == EngineArgs().decode_log_interval == 40
    assert build_parser().parse_args(["engine", "--decode-log-interval", "5"]).decode_log_interval == 5
    assert main(["engine", "--decode-log-interval", "0"]) == 2
    assert capsys.readouterr().err.startswith("radixserve engine: --decode-log-interval must be at least 1")
