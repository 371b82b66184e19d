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
        (("--worker-urls", "http://a:1", "--policy", "magic"), "--policy"),
        (("--worker-urls", "http://a:1", "--load-factor", "0.5"), "--load-factor"),
        (("--worker-urls", "http://a:1", "--block-tokens", "0"), "--block-tokens"),
        (("--worker-urls", "http://a:1", "--connect-timeout-s", "0"), "--connect-timeout-s"),
        (("--worker-urls", "http://a:1", "--pending-probe-interval-s", "0"), "--pending-probe-interval-s"),
    ],
)
def test_invalid_settings_name_the_flag(argv, needle):
    with pytest.raises(RouterConfigError, match=needle.replace("-", r"\-")):
        parse(*argv)


def test_service_discovery_flags():
    args = parse("--service-discovery", "--namespace", "ns", "--all-inference-services")
    assert args.service_discovery and args.namespace == "ns" and args.all_inference_services and not args.worker_urls
