"""The shipped examples/ are what users apply first: each one must render into children the real Kubernetes schemas
accept, and into engine/router command lines the engine's and router's own parsers accept (an unknown engine flag in
an example would crash-loop every engine pod)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from radixserve.operator.render import RenderOptions, render_children
from radixserve.operator.spec import InferenceService

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def _containers(children: list[dict]):
    for child in children:
        if child["kind"] == "Deployment":
            yield from child["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_renders_valid_children_and_parseable_command_lines(path: Path) -> None:
    from radixserve.launch.cli import build_parser

    doc = yaml.safe_load(path.read_text())
    doc["metadata"].setdefault("namespace", "default")
    doc["metadata"]["uid"] = "0b1c2d3e-0000-4000-8000-000000000001"
    children = render_children(InferenceService.model_validate(doc), RenderOptions(image="radixserve:0.1.0"))
    for child in children:
        kubernetes_validate.validate(child, "1.33.0", strict=True)
    commands = [c["args"][0] for c in _containers(children)]
    assert sorted(commands) == ["engine", "router"]
    for c in _containers(children):
        build_parser().parse_args(c["args"])  # SystemExit(2) on a flag the engine or router does not know


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 3
