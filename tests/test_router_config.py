"""Router flags and their validation (router/config.py)."""

import argparse

import pytest

from radixserve.router.config import RouterArgs, RouterConfigError, add_router_args, router_args_from_namespace


def parse(*argv: str) -> RouterArgs:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return router_args_from_namespace(parser.parse_args(list(argv)))


def test_flags_map_to_fields():
    args = parse(
        "--worker-urls",
        "http://127.0.0.1:30000/",
        "http://127.0.0.1:30001",
        "--policy",
        "round_robin",
        "--load-factor",
        "1.5",
        "--max-retries",
        "0",
        "--api-key",
        "k",
    )
    assert args.worker_urls == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    assert args.policy == "round_robin" and args.load_factor == 1.5 and args.max_retries == 0 and args.api_key == "k"
    assert args.port == 8000 and args.host == "127.0.0.1" and args.max_request_body_bytes == 8 * 1024 * 1024


@pytest.mark.parametrize(
    "argv, needle",
    [
        ((), "--worker-urls"),
        (("--worker-urls", "127.0.0.1:30000"), "http://"),
        (("--worker-urls", "http://a:1", "--service-discovery"), "not both"),
        (("--service-discovery",), "--service-name"),
        (("--worker-urls", "http://a:1", "--load-factor", "0.5"), "--load-factor"),
        (("--worker-urls", "http://a:1", "--cache-threshold", "1.5"), "--cache-threshold"),
        (("--worker-urls", "http://a:1", "--cache-threshold", "-0.1"), "--cache-threshold"),
        (("--worker-urls", "http://a:1", "--block-tokens", "0"), "--block-tokens"),
        (("--worker-urls", "http://a:1", "--connect-timeout-s", "0"), "--connect-timeout-s"),
        (("--worker-urls", "http://a:1", "--pending-probe-interval-s", "0"), "--pending-probe-interval-s"),
        (("--worker-urls", "http://a:1", "--shutdown-timeout", "-1"), "--shutdown-timeout"),
    ],
)
def test_invalid_settings_name_the_flag(argv, needle):
    with pytest.raises(RouterConfigError, match=needle.replace("-", r"\-")):
        parse(*argv)


def test_policy_outside_the_registry_names_the_flag():
    with pytest.raises(RouterConfigError, match=r"\-\-policy 'magic'"):
        RouterArgs(worker_urls=["http://a:1"], policy="magic").validate()


@pytest.mark.parametrize(
    "flag, choices",
    [
        ("--policy", ("prefix_hash", "least_load", "round_robin", "power_of_two")),
        ("--upstream-transport", ("aiohttp", "httpx")),
        ("--log-level", ("debug", "info", "warning", "error", "critical")),
    ],
)
def test_closed_flags_use_argparse_choices(flag, choices, capsys):
    with pytest.raises(SystemExit) as e:
        parse("--worker-urls", "http://a:1", flag, "magic")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "invalid choice: 'magic'" in err
    assert all(repr(c) in err for c in choices)


def test_every_router_flag_has_help_with_its_default():
    # Regression: `radixserve router --help` listed most flags bare, and --policy without its choices.
    import dataclasses

    from radixserve.router.policy import POLICIES

    parser = argparse.ArgumentParser()
    add_router_args(parser)
    by_dest = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(by_dest) == {f.name for f in dataclasses.fields(RouterArgs)}
    for name, action in by_dest.items():
        assert (action.help or "").strip(), f"{name} has no help"
        assert "\n" not in action.help, name
        if name in ("api_key", "engine_api_key"):
            assert "%(default)s" not in action.help, f"{name} would print the key"
        elif action.default not in (None, False, []):
            assert "%(default)s" in action.help, f"{name} does not show its default"
    assert tuple(by_dest["policy"].choices) == tuple(POLICIES)
    text = parser.format_help()
    assert "{" + ",".join(POLICIES) + "}" in text and "(default: prefix_hash)" in text


def test_service_discovery_flags():
    args = parse("--service-discovery", "--namespace", "ns", "--all-inference-services")
    assert args.service_discovery and args.namespace == "ns" and args.all_inference_services and not args.worker_urls


@pytest.mark.parametrize(
    "flag, field, env",
    [
        ("--api-key", "api_key", "RADIXSERVE_API_KEY"),
        ("--engine-api-key", "engine_api_key", "RADIXSERVE_ENGINE_API_KEY"),
    ],
)
def test_keys_default_from_the_environment_and_help_never_shows_them(monkeypatch, flag, field, env):
    # Issue 11: the router's keys could only be given on its command line (visible in ps, stored in pod specs).
    monkeypatch.setenv(env, "s3cret-from-env")
    assert getattr(parse("--worker-urls", "http://a:1"), field) == "s3cret-from-env"
    assert getattr(parse("--worker-urls", "http://a:1", flag, "from-flag"), field) == "from-flag"  # the flag wins
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    text = parser.format_help()
    assert "s3cret-from-env" not in text and "$" + env in text
    monkeypatch.setenv(env, "")
    assert getattr(parse("--worker-urls", "http://a:1"), field) is None  # empty: no key
    monkeypatch.delenv(env)
    assert getattr(parse("--worker-urls", "http://a:1"), field) is None


def test_shutdown_timeout_defaults_to_30_s_or_the_environment(monkeypatch, capsys):
    # Graceful drain (docs/contracts.md): the operator sets RADIXSERVE_SHUTDOWN_TIMEOUT for engine and router alike.
    monkeypatch.delenv("RADIXSERVE_SHUTDOWN_TIMEOUT", raising=False)
    assert parse("--worker-urls", "http://a:1").shutdown_timeout == 30.0
    monkeypatch.setenv("RADIXSERVE_SHUTDOWN_TIMEOUT", "120")
    assert parse("--worker-urls", "http://a:1").shutdown_timeout == 120.0
    assert parse("--worker-urls", "http://a:1", "--shutdown-timeout", "0").shutdown_timeout == 0.0  # the flag wins
    monkeypatch.setenv("RADIXSERVE_SHUTDOWN_TIMEOUT", "soon")
    with pytest.raises(SystemExit):  # a usage error naming the flag, as a bad flag value
        parse("--worker-urls", "http://a:1")
    assert "--shutdown-timeout: invalid float value: 'soon'" in capsys.readouterr().err
