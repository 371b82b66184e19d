"""The import rules in .importlinter are live: the tree keeps them, and a deliberate break of each one fails
``lint-imports`` (what ``make lint`` runs) with a message naming the offending import."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (the dev extra)")


def lint_imports(src: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports with the project's config over the package under ``src`` (found first on PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / ".importlinter"), "--no-cache"],
        cwd=src.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of src/ to break on purpose."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return src


def append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_the_tree_keeps_the_import_rules(tree: Path) -> None:
    proc = lint_imports(tree)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "broken" in proc.stdout and "0 broken" in proc.stdout


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        # a wing importing another wing
        (
            "engine/engine.py",
            "from radixserve.router import types as _t",
            "radixserve.engine.engine -> radixserve.router",
        ),
        ("router/proxy.py", "import radixserve.operator.spec", "radixserve.router.proxy -> radixserve.operator.spec"),
        ("operator/render.py", "import radixserve.engine.config", "radixserve.operator.render -> radixserve.engine"),
        # the contracts layer importing a wing or a launcher
        ("contracts/constants.py", "import radixserve.router.types", "radixserve.contracts.constants -> radixserve"),
        ("contracts/edge.py", "import radixserve.launch.cli", "radixserve.contracts.edge -> radixserve.launch.cli"),
        # a wing importing a launcher
        ("router/app.py", "import radixserve.launch.local_stack", "radixserve.router.app -> radixserve.launch"),
        # torch outside the engine
        ("router/prefix_key.py", "import torch", "radixserve.router.prefix_key -> torch"),
        ("operator/status.py", "import transformers", "radixserve.operator.status -> transformers"),
    ],
)
def test_a_broken_rule_fails_the_lint(tree: Path, module: str, line: str, expected: str) -> None:
    append(tree / "radixserve" / module, line)
    proc = lint_imports(tree)
    assert proc.returncode != 0, proc.stdout
    assert "BROKEN" in proc.stdout
    assert expected in proc.stdout, proc.stdout
