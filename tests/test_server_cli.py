"""The radixserve console script's argument handling (no server is started here)."""

import os

import pytest

from radixserve.contracts import constants
from radixserve.launch.cli import build_parser, main, resolve_model_path

from conftest import requires_demo_gguf


def test_operator_with_an_unknown_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["operator", "-A", "--whatever"])
    assert exc.value.code == 2
    assert "--whatever" in capsys.readouterr().err


def test_router_without_workers_is_a_clear_usage_error(capsys):
    assert main(["router"]) == 2
    assert "--worker-urls" in capsys.readouterr().err


def test_up_forwards_engine_flags_and_splits_threads():
    from radixserve.engine.config import engine_args_from_namespace
    from radixserve.launch.local_stack import engine_argv, split_threads

    ns = build_parser().parse_args(
        ["up", "--context-length", "2048", "--disable-radix-cache", "--engines", "3", "--policy", "round_robin"]
    )
    assert (ns.engines, ns.policy) == (3, "round_robin")
    argv = engine_argv(engine_args_from_namespace(ns), 30001, 2)
    assert argv[1:4] == ["-m", "radixserve", "engine"]
    flags = argv[4:]
    assert flags[flags.index("--port") + 1] == "30001" and flags[flags.index("--num-threads") + 1] == "2"
    assert flags[flags.index("--context-length") + 1] == "2048" and "--disable-radix-cache" in flags
    assert flags[flags.index("--host") + 1] == "127.0.0.1"
    assert flags.count("--port") == 1  # the router's public --port is not forwarded
    assert "--preferred-sampling-params" in flags  # `up`'s greedy default reaches the engines
    assert "--max-running-requests" not in flags  # defaults are left to the engine
    assert "--no-warmup" not in flags and "--warmup" not in flags
    ns = build_parser().parse_args(["up", "--no-warmup"])
    assert "--no-warmup" in engine_argv(engine_args_from_namespace(ns), 30000, 1)  # a default-on switch turned off
    assert split_threads(2, 2) == 1 and split_threads(1, 2) == 1 and split_threads(16, 3) == 5


def test_up_help_says_which_flags_reach_the_engines_and_which_the_router(monkeypatch):
    # Regression: `up --help` (and README) said --api-key/--log-level/--max-request-body-bytes applied to the router
    # only; engine_argv forwards them to every engine as well (the router gets them too, the key as engine_api_key).
    from radixserve.engine.config import engine_args_from_namespace
    from radixserve.launch import cli, local_stack
    from radixserve.launch.local_stack import engine_argv

    shared = {"--log-level": "debug", "--max-request-body-bytes": "1000"}
    argv = ["up", "--host", "0.0.0.0", "--port", "9000", "--api-key", "k", *sum(shared.items(), ())]
    ns = build_parser().parse_args(argv)
    flags = engine_argv(engine_args_from_namespace(ns), 30000, 1)[4:]
    for flag, value in shared.items():  # how the key reaches the engines is local_stack's business, not pinned here
        assert flags[flags.index(flag) + 1] == value, flag
    assert flags[flags.index("--host") + 1] == "127.0.0.1" and flags[flags.index("--port") + 1] == "30000"
    seen = {}
    monkeypatch.setattr(local_stack, "run_local_stack", lambda engine_args, router_args, *a: seen.update(r=router_args))
    monkeypatch.setattr(cli, "resolve_model_paths", lambda args: None)
    cli.run_up(engine_args_from_namespace(ns), ns)
    r = seen["r"]
    assert (r.host, r.port, r.log_level, r.max_request_body_bytes) == ("0.0.0.0", 9000, "debug", 1000)
    assert r.api_key == r.engine_api_key == "k"  # the router checks the key and calls the engines with it
    up = next(a for a in build_parser()._actions if a.dest == "command").choices["up"]
    text = " ".join(up.description.split())
    assert "--host/--port are the router's" in text
    assert "--log-level and --max-request-body-bytes included: those two apply to the router too" in text
    assert "--api-key (default: $RADIXSERVE_API_KEY) applies to the router and to every engine" in text
    assert "in their environment (RADIXSERVE_API_KEY), never on their command line" in text


def test_up_help_says_it_defaults_temperature_to_0_and_names_the_key_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Regression (issue 11): `up --help` did not say that `up` defaults temperature to 0 (its engines get
    # --preferred-sampling-params '{"temperature": 0.0}'), and must name the key's variable without its value.
    monkeypatch.setenv("RADIXSERVE_API_KEY", "sk-never-shown-4321")
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "up defaults temperature to 0: it passes --preferred-sampling-params '{\"temperature\": 0.0}'" in text
    assert "a request that sets it gets what it asks for" in text
    assert "RADIXSERVE_API_KEY" in text and "sk-never-shown-4321" not in text
    assert build_parser().parse_args(["up"]).api_key == "sk-never-shown-4321"  # the default, from the environment
    assert build_parser().parse_args(["up", "--api-key", "k"]).api_key == "k"  # the flag wins


def test_up_defaults_to_the_public_endpoint_and_demo_model():
    ns = build_parser().parse_args(["up"])
    assert (ns.host, ns.port) == (constants.PUBLIC_HOST, constants.PUBLIC_PORT)
    assert ns.model_path == constants.DEMO_MODEL_URI  # the wheel's GGUF, served as stored (issue 14)
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


@requires_demo_gguf
@pytest.mark.parametrize("command", ["engine", "up"])
def test_the_default_model_is_the_demo_gguf_served_as_the_demo_name(command, tmp_path, monkeypatch):
    from radixserve.engine.config import engine_args_from_namespace
    from radixserve.engine.model.convert import find_demo_gguf
    from radixserve.launch.cli import resolve_model_paths

    monkeypatch.chdir(tmp_path)
    args = engine_args_from_namespace(build_parser().parse_args([command]))
    resolve_model_paths(args)
    assert (args.model_path, args.served_model_name) == (find_demo_gguf(), constants.DEMO_MODEL_NAME)
    args = engine_args_from_namespace(build_parser().parse_args([command, "--served-model-name", "mine"]))
    resolve_model_paths(args)
    assert (args.model_path, args.served_model_name) == (find_demo_gguf(), "mine")


def test_an_unknown_demo_model_is_a_one_line_error(capsys):
    assert main(["engine", "--model-path", "demo://llama-70b"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "radixserve engine: --model-path demo://llama-70b: unknown demo model (the demo model is "
        f"{constants.DEMO_MODEL_URI})"
    )


def test_up_passes_the_model_path_even_when_it_equals_the_engine_default():
    # Regression: `up --model-path models/smollm2-135m-instruct` equals EngineArgs' default, so no flag reached the
    # engines, and their CLI default (the demo GGUF) was served instead of the directory asked for.
    from radixserve.engine.config import engine_args_from_namespace
    from radixserve.launch.local_stack import engine_argv

    ns = build_parser().parse_args(["up", "--model-path", constants.DEMO_MODEL_DIR])
    argv = engine_argv(engine_args_from_namespace(ns), 30000, 1)
    assert argv[argv.index("--model-path") + 1] == constants.DEMO_MODEL_DIR


def test_missing_subcommand_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2


def test_bad_log_level_is_a_usage_error_not_a_traceback(capsys):
    # Regression: `radixserve router --log-level loud` died with a ValueError traceback.
    with pytest.raises(SystemExit) as e:
        main(["router", "--worker-urls", "http://127.0.0.1:1", "--log-level", "loud"])
    assert e.value.code == 2
    assert "--log-level" in capsys.readouterr().err


_ENGINE_CHOICES = {
    "--schedule-policy": ("lpm", "fcfs"),
    "--attention-backend": ("auto", "torch", "flashinfer"),
    "--device": ("auto", "cpu", "cuda"),
    "--dtype": ("auto", "float32", "bfloat16", "float16"),
    "--log-level": ("debug", "info", "warning", "error", "critical"),
}


@pytest.mark.parametrize("command", ["engine", "up"])
@pytest.mark.parametrize("flag", sorted(_ENGINE_CHOICES))
def test_bad_engine_choice_exits_2_listing_the_choices(command, flag, capsys, monkeypatch):
    # Regression: `radixserve engine --schedule-policy foo` started and reported healthy; the first request crashed
    # the scheduler loop ("unknown schedule policy") and every later one was answered 503.
    from radixserve.launch import cli

    def must_not_run(*a, **k):
        raise AssertionError("a bad flag reached the server")

    monkeypatch.setattr(cli, "run_up", must_not_run)
    with pytest.raises(SystemExit) as e:
        main([command, flag, "foo"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "invalid choice: 'foo'" in err
    for choice in _ENGINE_CHOICES[flag]:
        assert repr(choice) in err


@pytest.mark.parametrize("command", ["engine", "up"])
def test_engine_help_lists_the_choices(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag, choices in _ENGINE_CHOICES.items():
        assert f"{flag} {{{','.join(choices)}" in text, flag


def test_engine_choices_match_the_code_that_uses_them():
    from radixserve.engine.attention.base import BACKEND_NAMES
    from radixserve.engine.config import ATTENTION_BACKENDS, DTYPES, SCHEDULE_POLICIES
    from radixserve.engine.model.runner import _DTYPES
    from radixserve.engine.scheduler.policy import POLICIES

    assert SCHEDULE_POLICIES == POLICIES and ATTENTION_BACKENDS == BACKEND_NAMES
    assert set(DTYPES) == {"auto", *_DTYPES}


def test_good_engine_choices_parse_and_log_level_is_case_insensitive():
    from radixserve.engine.config import engine_args_from_namespace

    argv = ["engine", "--schedule-policy", "fcfs", "--attention-backend", "torch", "--device", "cpu"]
    ns = build_parser().parse_args([*argv, "--dtype", "bf16", "--log-level", "WARNING"])
    args = engine_args_from_namespace(ns)
    assert (args.schedule_policy, args.attention_backend, args.device) == ("fcfs", "torch", "cpu")
    assert (args.dtype, args.log_level) == ("bf16", "warning")


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--port", "70000"),
        ("--port", "-1"),
        ("--context-length", "0"),
        ("--max-total-tokens", "0"),
        ("--max-running-requests", "0"),
        ("--max-queued-requests", "0"),
        ("--max-prefill-tokens", "-5"),
        ("--chunked-prefill-size", "0"),
        ("--num-threads", "0"),
        ("--stream-interval", "0"),
        ("--max-request-body-bytes", "0"),
        ("--default-chat-max-tokens", "0"),
    ],
)
@pytest.mark.parametrize("command", ["engine", "up"])
def test_out_of_range_engine_numbers_exit_2_naming_the_flag(command, flag, value, capsys, monkeypatch):
    from radixserve.launch import cli

    def must_not_run(*a, **k):
        raise AssertionError("a bad flag reached the server")

    monkeypatch.setattr(cli, "run_up", must_not_run)
    assert main([command, flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"radixserve {command}: {flag}") and value in err


def test_engine_args_defaults_are_valid():
    from radixserve.engine.config import EngineArgs, validate_engine_args

    validate_engine_args(EngineArgs())
    with pytest.raises(ValueError, match="--schedule-policy 'foo'"):
        validate_engine_args(EngineArgs(schedule_policy="foo"))


def test_version(capsys):
    import radixserve

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"radixserve {radixserve.__version__}\n"


def test_up_refuses_busy_or_clashing_ports():
    # Regression: with an engine port already taken, `up` fronted the other process while its own engine restarted
    # forever; with the router on an engine port, the router probed itself.
    import socket

    from radixserve.launch.local_stack import check_ports_free

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is not free"):
            check_ports_free([("127.0.0.1", port)])
    with pytest.raises(ValueError, match="given to two servers"):
        check_ports_free([("127.0.0.1", port), ("127.0.0.1", port)])
    check_ports_free([("127.0.0.1", port)])  # free again once closed


def test_up_with_a_busy_engine_port_exits_2_before_starting_engines(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["up", "--engines", "1", "--engine-base-port", str(port), "--port", "0"]) == 2
    assert f"port {port}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["engine", "up"])
def test_every_engine_flag_has_help(command, capsys):
    # Regression: `radixserve engine --help` listed every EngineArgs flag without a word of help.
    import dataclasses

    from radixserve.engine.config import EngineArgs

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    by_flag = {s: a for a in sub._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text
        assert (by_flag[flag].help or "").strip(), f"{flag} has no help"


def test_warmup_can_be_turned_off():
    # `--warmup` defaulted to on with store_true: there was no way to turn it off.
    assert build_parser().parse_args(["engine"]).warmup is True
    assert build_parser().parse_args(["engine", "--no-warmup"]).warmup is False


@pytest.mark.parametrize(
    "flags",
    [
        ["--engines", "2", "--engine-base-port", "65535"],
        ["--engine-base-port", "70000"],
        ["--engine-base-port", "0"],
        ["--engines", "0"],
    ],
)
def test_up_with_engine_ports_out_of_range_exits_2_naming_the_flag(flags, capsys):
    """Regression: ``up --engine-base-port 65535`` (two engines: 65535 and 65536) crashed with an OverflowError
    traceback from the port check."""
    assert main(["up", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixserve up: --engine") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_up_help_states_the_defaults_of_its_own_flags(capsys):
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "this port + i (default: 30000)" in out
    assert "(default: prefix_hash)" in out and "(default: 1: on 2 cores" in out


def test_a_gguf_in_any_case_is_named_without_its_extension():
    # Regression (new-user try): `--model-path .../Model.GGUF` was served as `model.gguf`.
    from radixserve.engine.engine import default_served_model_name

    for path in ("/m/Model.GGUF", "/m/Model.gguf", "models/SmolLM2-135M/"):
        assert default_served_model_name(path) in ("model", "smollm2-135m")
    assert default_served_model_name("/m/Model.GGUF") == "model"
