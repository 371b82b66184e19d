"""docs/contracts.md stays true to the code.

Every contract value in ``radixserve.contracts.constants`` (ports, paths, headers, route reasons, metric names, error
types, labels, CRD names) must appear in docs/contracts.md, and the other way round where a name can be recognised:
every ``radixserve_{engine,router,operator}_*`` metric and every ``x-...`` header that the docs mention must exist.
Renaming a constant without updating the docs (or the docs without the code) fails here. No model, no server.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest

from radixserve.contracts import constants as c
from radixserve.contracts.json_body import parse_json_object
from radixserve.contracts.protocol import GenerateReqInput, error_body
from radixserve.engine.io_struct import SamplingParams
from radixserve.launch.cli import build_parser
from radixserve.router.readiness import public_url
from radixserve.router.types import RouteReason

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ROOT / "docs" / "contracts.md"
# Docs whose metric names and headers must exist too (the reverse checks).
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

HEADERS = {c.HEADER_REQUEST_ID, c.HEADER_WORKER, c.HEADER_ROUTE_REASON, c.HEADER_DRAINING}
_METRIC_RE = re.compile(r"radixserve_(?:engine|router|operator)_[a-z0-9_]+")
_HEADER_RE = re.compile(r"(?<![\w-])x-[a-z][a-z0-9-]*[a-z0-9]", re.IGNORECASE)
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@pytest.fixture(scope="module")
def doc() -> str:
    return CONTRACTS.read_text(encoding="utf-8")


def section(doc: str, title: str) -> str:
    """The text of the ``## title`` section (up to the next ``## ``)."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", doc, re.M | re.S)
    assert m, f"docs/contracts.md has no '## {title}' section"
    return m.group(1)


def spans(text: str) -> set[str]:
    """The contents of the inline code spans of ``text``."""
    return set(re.findall(r"`([^`\n]+)`", text))


def has_word(text: str, word: str) -> bool:
    """``word`` occurs in ``text`` as a whole token (not inside a longer name or number)."""
    return re.search(rf"(?<![\w./-]){re.escape(word)}(?![\w-])", text) is not None


def metric_names() -> dict[str, str]:
    """Every contract metric's full name -> its type (gauge, counter, histogram)."""
    out: dict[str, str] = {}
    for prefix, gauges, counters, histograms in (
        (c.ENGINE_METRIC_PREFIX, c.ENGINE_GAUGES, c.ENGINE_COUNTERS, c.ENGINE_HISTOGRAMS),
        (c.ROUTER_METRIC_PREFIX, c.ROUTER_GAUGES, c.ROUTER_COUNTERS, c.ROUTER_HISTOGRAMS),
        (c.OPERATOR_METRIC_PREFIX, c.OPERATOR_GAUGES, c.OPERATOR_COUNTERS, c.OPERATOR_HISTOGRAMS),
    ):
        for kind, names in (("gauge", gauges), ("counter", counters), ("histogram", histograms)):
            for name in names:
                out[prefix + name] = kind
    return out


# ---------------------------------------------------------------------------------------------- constants -> doc


def test_commands(doc):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    commands = set(sub.choices)
    text = section(doc, "Commands")
    for cmd in commands:
        assert f"`radixserve {cmd}`" in text, f"subcommand {cmd!r} is not documented"
    mentioned = set(re.findall(r"`(?:python -m )?radixserve ([a-z][a-z-]*)", doc))
    assert mentioned <= commands, f"docs name subcommands the CLI lacks: {sorted(mentioned - commands)}"
    assert "`python -m radixserve`" in text
    up = build_parser().parse_args(["up"])
    assert (up.host, up.port, up.engine_base_port) == (c.PUBLIC_HOST, c.PUBLIC_PORT, c.ENGINE_PORT)
    assert f"**{c.PUBLIC_HOST}:{c.PUBLIC_PORT}**" in text
    assert f"`ready: {public_url(c.PUBLIC_HOST, c.PUBLIC_PORT)} — <model> on N engines`" in text
    assert f"`{c.DEMO_MODEL_NAME}`" in text and has_word(text, str(c.DEMO_MODEL_CONTEXT_LENGTH))
    assert has_word(text, str(c.OPERATOR_METRICS_PORT))


def test_ports(doc):
    rows = [line.strip("|").split("|") for line in section(doc, "Ports").splitlines() if line.startswith("|")]

    def port(*needles: str) -> str:
        """The port cell of the one table row whose first cell holds every needle."""
        found = [cells[-1].strip() for cells in rows if all(n in cells[0] for n in needles)]
        assert len(found) == 1, f"expected one row of the ports table with {needles}, got {found}"
        return found[0]

    assert port("public endpoint") == f"{c.PUBLIC_HOST}:{c.PUBLIC_PORT}"
    assert port("`radixserve engine`") == str(c.ENGINE_PORT)
    assert port("`radixserve router`") == str(c.ROUTER_PORT)
    assert port("router Service") == f"{c.ROUTER_SERVICE_PORT}, target port `{c.HTTP_PORT_NAME}`"
    assert port("operator") == f"{c.OPERATOR_METRICS_PORT}, port name `metrics`"
    assert f"container ports are both named `{c.HTTP_PORT_NAME}`" in section(doc, "Ports")


def test_kubernetes_names_and_labels(doc):
    text = section(doc, "Kubernetes names and labels")
    code = spans(text)
    for value in (c.API_GROUP, c.API_VERSION, c.CRD_KIND, c.CRD_PLURAL, c.CRD_SHORT_NAME, c.MODEL_MOUNT_PATH):
        assert value in code, f"{value!r} is not in the Kubernetes section"
    assert c.DEMO_MODEL_IMAGE_DIR in code
    assert f"{c.IMAGE_REPOSITORY}:<version>" in code
    for name in (c.engine_deployment_name("NAME"), c.router_deployment_name("NAME"), c.router_service_name("NAME")):
        assert name in code
    for label in (
        f"{c.LABEL_NAME}={c.LABEL_NAME_VALUE}",
        f"{c.LABEL_COMPONENT}={c.COMPONENT_ENGINE}",
        f"{c.LABEL_COMPONENT}={c.COMPONENT_ROUTER}",
        f"{c.LABEL_INFERENCE_SERVICE}=NAME",
        f"{c.LABEL_SERVICE_NAME}={c.engine_deployment_name('NAME')}",
        c.LABEL_INFERENCE_SERVICE,
    ):
        assert label in code, f"label {label!r} is not in the Kubernetes section"


def test_health_paths(doc):
    text = section(doc, "Health and readiness")
    for who, path in (
        ("Engine", c.ENGINE_HEALTH_PATH),
        ("Engine", c.ENGINE_HEALTH_GENERATE_PATH),
        ("Router", c.ROUTER_LIVE_PATH),
        ("Router", c.ROUTER_HEALTH_PATH),
        ("Router", c.ROUTER_READY_PATH),
    ):
        assert f"- {who} `GET {path}`" in text, f"{who} {path} is not documented"
    shown = re.search(r"`state` = (.*?) \(routable again", text, re.S)
    assert shown, "the router's worker states are not listed"
    states = tuple(re.findall(r"`([a-z-]+)`", shown.group(1)))
    assert states == c.ROUTER_WORKER_STATES, "the worker states listed differ from constants.ROUTER_WORKER_STATES"
    assert f"`GET {c.ENGINE_TOKENIZER_FILES_PATH}`" in doc


def test_native_generate(doc):
    text = section(doc, "Native `POST /generate` (engine and router)")
    for field in GenerateReqInput.model_fields:
        assert f'"{field}"' in text, f"GenerateReqInput.{field} is not documented"
    for f in dataclasses.fields(SamplingParams):
        assert f"`{f.name}`" in text, f"sampling_params.{f.name} is not documented"
    assert f"(default {SamplingParams().max_new_tokens}," in text
    assert "`--preferred-sampling-params`" in text and f"`{c.DEMO_MODEL_SAMPLING_DEFAULTS}`" in text


def test_error_body_and_types(doc):
    text = section(doc, "Errors")
    body = error_body("m", 400, "p")
    shown = re.search(r"`(\{\"error\": \{.*?\}\})`", text, re.S)
    assert shown, "the error body is not shown"
    (outer,) = body
    keys = [outer, *body[outer]]
    assert re.findall(r'"(\w+)":', shown.group(1)) == keys, "the error body's keys differ from error_body()"
    assert '`{"object": "error", "message": ...}`' in text and "is gone" in text, "the old flat body is not retired"
    broken = parse_json_object(b'{"messages": [{"role": "user"}   {"role": "user"}]}')
    assert f"`{broken}`" in " ".join(text.split()), "the broken-JSON message shown differs from parse_json_object()"
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\| `(\d{3})` \| `([a-z_]+)` \|", text, re.M)}
    assert rows == c.ERROR_TYPES, "the status/type table differs from constants.ERROR_TYPES"
    assert "never a 422" in text


def test_headers_and_route_reasons(doc):
    text = section(doc, "Headers")
    for header in HEADERS:
        assert f"- `{header}`:" in text, f"header {header} is not documented"
    reasons = re.findall(r"^  - `([a-z-]+)`:", text, re.M)
    assert tuple(reasons) == c.ROUTE_REASONS, "the route reasons listed differ from constants.ROUTE_REASONS"
    assert typing.get_args(RouteReason) == c.ROUTE_REASONS, "router.types.RouteReason differs from the contract"


def test_every_metric_is_documented(doc):
    text = section(doc, "Metrics")
    missing = [name for name in metric_names() if not has_word(text, name)]
    assert not missing, f"metrics missing from docs/contracts.md: {missing}"


# ---------------------------------------------------------------------------------------------- doc -> constants


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_documented_metrics_exist(path):
    known = metric_names()
    unknown = set()
    for name in _METRIC_RE.findall(path.read_text(encoding="utf-8")):
        base = name
        for suffix in _HISTOGRAM_SUFFIXES:
            if name.endswith(suffix) and known.get(name.removesuffix(suffix)) == "histogram":
                base = name.removesuffix(suffix)
        if base not in known:
            unknown.add(name)
    assert not unknown, f"{path.name} names metrics that constants.py does not define: {sorted(unknown)}"


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_documented_headers_exist(path):
    found = {h.lower() for h in _HEADER_RE.findall(path.read_text(encoding="utf-8"))}
    assert found <= HEADERS, f"{path.name} names headers that constants.py does not define: {sorted(found - HEADERS)}"


def test_checks_can_fail():
    """The matchers used above do catch a renamed value."""
    assert not has_word("`radixserve_engine_num_queue_reqs_old`", "radixserve_engine_num_queue_reqs")
    assert not has_word("port 300001", "30000") and has_word("| 30000 |", "30000")
    assert _HEADER_RE.findall("`x-radixserve-workers`") == ["x-radixserve-workers"]
    assert "radixserve_engine_num_queue_reqs_total" not in metric_names()
