"""Test helpers around a real helm v3 binary (fetched into .tools/bin by scripts/fetch_tools.sh / `make tools`).

``helm_bin()`` finds the binary: a test that needs it is skipped with a clear reason when it is absent locally, and
fails when it is absent in CI (env ``CI`` set), so CI can never pass by skipping the chart tests.
``helm_template()`` renders charts/radixserve offline and returns the objects; ``helm_lint()`` and ``run_helm()``
return the finished process. Rendering errors (schema refusals, template ``fail``) raise ``HelmError`` with helm's
stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from typing import Any

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHART_DIR = os.path.join(ROOT, "charts", "radixserve")
HELM_PATH = os.path.join(ROOT, ".tools", "bin", "helm")
RELEASE_NAME = "radixserve"
HELM_TIMEOUT_S = 120  # helm is a static binary and renders in well under a second; generous for a busy 2-core box


class HelmError(RuntimeError):
    """helm exited non-zero; ``returncode`` and ``output`` (stdout + stderr) say why."""

    def __init__(self, args: list[str], returncode: int, output: str):
        super().__init__(f"helm {' '.join(args[1:])} exited {returncode}:\n{output}")
        self.returncode = returncode
        self.output = output


def helm_bin() -> str:
    """Path of the helm v3 binary (.tools/bin/helm).

    Skips the calling test when it is absent, unless env ``CI`` is set: then the test fails (run ``make tools``).
    """
    if os.access(HELM_PATH, os.X_OK):
        return HELM_PATH
    message = f"helm not found at {HELM_PATH}; run `make tools` (scripts/fetch_tools.sh)"
    if os.environ.get("CI"):
        pytest.fail(f"{message} -- CI must run the chart tests, not skip them")
    pytest.skip(message)


def run_helm(args: list[str], values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``helm ARGS [-f VALUES]`` (values written to a temporary YAML file); never raises on a non-zero exit."""
    cmd = [helm_bin(), *args]
    with tempfile.TemporaryDirectory() as tmp:
        if values is not None:
            path = os.path.join(tmp, "values.yaml")
            with open(path, "w") as f:
                json.dump(values, f)  # JSON is YAML, and keeps types exact (no "yes" -> true surprises)
            cmd += ["-f", path]
        # HELM_* cache/config dirs in the temp dir: no writes to $HOME, no shared state between tests.
        env = {**os.environ, "HELM_CACHE_HOME": tmp, "HELM_CONFIG_HOME": tmp, "HELM_DATA_HOME": tmp}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=HELM_TIMEOUT_S, env=env, cwd=ROOT)


def helm_lint(values: dict[str, Any] | None = None, *, strict: bool = True) -> subprocess.CompletedProcess[str]:
    """``helm lint [--strict] charts/radixserve [-f VALUES]``; the caller checks ``returncode``."""
    return run_helm(["lint", *(["--strict"] if strict else []), CHART_DIR], values)


def helm_template(
    values: dict[str, Any] | None = None,
    *,
    namespace: str = "radixserve",
    kube_version: str = "1.30.0",
    include_crds: bool = True,
) -> list[dict[str, Any]]:
    """Render charts/radixserve as release ``radixserve`` in ``namespace`` for Kubernetes ``kube_version``.

    Returns the rendered objects in helm's order (empty documents dropped). Raises ``HelmError`` when helm refuses
    (values schema, template ``fail``, kubeVersion constraint).
    """
    args = ["template", RELEASE_NAME, CHART_DIR, "--namespace", namespace, "--kube-version", kube_version]
    if include_crds:
        args.append("--include-crds")
    proc = run_helm(args, values)
    if proc.returncode != 0:
        raise HelmError(args, proc.returncode, proc.stdout + proc.stderr)
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
