"""The radixserve console script's argument handling (no server is started here)."""

import os

import pytest

from radixserve import constants
from radixserve.cli import build_parser, main, resolve_model_path


@pytest.mark.parametrize("cmd, issue", [("router", 3), ("operator", 5)])
def test_not_implemented_subcommands_exit_2(cmd, issue, capsys):
    assert main([cmd, "--worker-urls", "x"]) == 2
    assert f"issue {issue}" in capsys.readouterr().err


def test_up_defaults_to_the_public_endpoint_and_demo_model():
    ns = build_parser().parse_args(["up"])
    assert (ns.host, ns.port) == (constants.PUBLIC_HOST, constants.PUBLIC_PORT)
    assert ns.model_path == constants.DEMO_MODEL_DIR
    # Regression: `up` answered "What is the capital of France?" incoherently about half the time when sampling.
    from radixserve.engine.engine import parse_sampling_defaults

    assert parse_sampling_defaults(ns.preferred_sampling_params) == {"temperature": 0.0}
    assert build_parser().parse_args(["engine"]).preferred_sampling_params is None
    ns = build_parser().parse_args(["up", "--context-length", "2048", "--port", "9000"])
    assert ns.context_length == 2048 and ns.port == 9000


def test_engine_defaults_to_engine_port():
    ns = build_parser().parse_args(["engine", "--model-path", "m", "--disable-radix-cache"])
    assert ns.port == constants.ENGINE_PORT and ns.model_path == "m" and ns.disable_radix_cache is True


def test_demo_model_path_resolves_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    resolved = resolve_model_path(constants.DEMO_MODEL_DIR)
    assert os.path.isabs(resolved) and os.path.isdir(resolved)
    assert resolve_model_path("does/not/exist") == "does/not/exist"


def test_missing_subcommand_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
