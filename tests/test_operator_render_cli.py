"""``radixserve render -f isvc.yaml`` (issue 11: "no offline way to print the objects an InferenceService renders to").

The printed objects are the operator's own (``render_children`` of the parsed file), valid for the real Kubernetes
OpenAPI schemas; bad input is one line on stderr and exit status 2, nothing on stdout.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from radixserve.contracts import constants
from radixserve.launch.cli import main
from radixserve.operator.main import DEFAULT_IMAGE
from radixserve.operator.render import RenderOptions, render_children
from radixserve.operator.spec import InferenceService

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
DEMO = ROOT / "examples" / "inferenceservice-demo.yaml"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["render", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_render_to_the_operators_children_and_validate(path, capsys):
    code, out, err = run(["-f", str(path)], capsys)
    assert code == 0, err
    assert out.startswith("---\n")
    objects = list(yaml.safe_load_all(out))
    body = yaml.safe_load(path.read_text())
    body["metadata"].setdefault("namespace", "default")
    assert objects == render_children(InferenceService.model_validate(body), RenderOptions(DEFAULT_IMAGE))
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33.0", strict=True)
        assert "ownerReferences" not in obj["metadata"]  # no uid offline
    kinds = {o["kind"] for o in objects}
    assert {"ConfigMap", "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"} <= kinds


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_output_has_no_yaml_anchors_or_aliases(path, capsys):
    """Issue 11 round 2: the output said ``matchLabels: &id001`` ... ``labels: *id001`` (a dict shared between
    objects); every object now spells out its own values."""
    code, out, err = run(["-f", str(path)], capsys)
    assert code == 0, err
    assert not re.search(r"[&*]id\d+", out), [line for line in out.splitlines() if re.search(r"[&*]id\d+", line)]
    events = {type(e).__name__ for e in yaml.parse(out)}
    assert "AliasEvent" not in events
    assert all(getattr(e, "anchor", None) is None for e in yaml.parse(out))
    (engine,) = [
        o for o in yaml.safe_load_all(out) if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-engine")
    ]
    assert engine["spec"]["selector"]["matchLabels"].items() <= engine["spec"]["template"]["metadata"]["labels"].items()


def test_flags_set_image_namespace_and_pull_policy(capsys):
    code, out, _ = run(
        ["-f", str(DEMO), "-n", "ml", "--image", "reg.example/rs:1", "--image-pull-policy", "Always"], capsys
    )
    assert code == 0
    objects = list(yaml.safe_load_all(out))
    assert {o["metadata"]["namespace"] for o in objects} == {"ml"}
    (engine,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "smollm2-demo-engine"]
    (c,) = engine["spec"]["template"]["spec"]["containers"]
    assert (c["image"], c["imagePullPolicy"]) == ("reg.example/rs:1", "Always")


def test_a_namespace_in_the_file_wins_and_several_documents_and_stdin_work(monkeypatch, capsys):
    body = yaml.safe_load(DEMO.read_text())
    first = {**body, "metadata": {"name": "a", "namespace": "team-a"}}
    second = {**body, "metadata": {"name": "b"}}
    monkeypatch.setattr(sys, "stdin", io.StringIO(yaml.safe_dump_all([first, second])))
    code, out, err = run(["-f", "-", "-n", "team-b"], capsys)
    assert code == 0, err
    names = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in yaml.safe_load_all(out)}
    assert ("team-a", "a-engine") in names and ("team-b", "b-engine") in names


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "isvc.yaml"
    path.write_text(text)
    return str(path)


def _isvc(spec: str, name: str = "chat") -> str:
    return f"apiVersion: radixserve.io/v1alpha1\nkind: InferenceService\nmetadata:\n  name: {name}\nspec:\n{spec}"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\n", "expected apiVersion radixserve.io/v1alpha1"),
        (_isvc("  model: {storageUri: 's3://bucket/m'}\n"), "invalid spec: spec.model.storageUri"),
        (_isvc("  model: {storageUri: 'demo://smollm2-135m-instruct'}\n  replicas: -1\n"), "spec.replicas"),
        (_isvc("  model: {storageUri: 'demo://smollm2-135m-instruct'}\n", name="llama3.1-8b"), "DNS-1035"),
        (_isvc("  model: {storageUri: 'demo://smollm2-135m-instruct'}\n  routr: {}\n"), "spec.routr"),
        ("apiVersion: radixserve.io/v1alpha1\nkind: InferenceService\nspec: {}\n", "metadata.name is missing"),
        ("kind: [unclosed\n", "not YAML"),
        ("", "no YAML document"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, text, words):
    path = _write(tmp_path, text)
    code, out, err = run(["-f", path], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"radixserve render: {path}") and words in err, err


def test_a_missing_file_is_one_line_and_exit_2(capsys):
    code, out, err = run(["-f", "/nonexistent/isvc.yaml"], capsys)
    assert (code, out) == (2, "") and err == "radixserve render: /nonexistent/isvc.yaml: No such file or directory\n"


def test_a_key_in_args_is_rendered_with_a_warning(tmp_path, capsys):
    spec = "  model: {storageUri: 'demo://smollm2-135m-instruct'}\n  router: {args: [--api-key, sk-plain]}\n"
    code, out, err = run(["-f", _write(tmp_path, _isvc(spec))], capsys)
    assert code == 0 and "spec.router.args --api-key is stored in plain text" in err and "sk-plain" not in err


def test_the_console_script_renders_without_a_cluster(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve", "render", "-f", str(DEMO)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    kinds = [o["kind"] for o in yaml.safe_load_all(proc.stdout)]
    assert kinds.count("Deployment") == 2 and constants.CRD_KIND not in kinds
