"""Commit style from the src/ layout change on: a subject of at most 72 characters, the details in the body."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RULE_SINCE = "6d1af88"  # the last commit before the rule (earlier subjects were long)
MAX_SUBJECT = 72


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


def test_commit_subjects_fit_in_72_characters() -> None:
    if git("rev-parse", "--git-dir").returncode != 0 or git("cat-file", "-e", f"{RULE_SINCE}^{{commit}}").returncode:
        pytest.skip("not a git checkout with the project's history (e.g. an sdist or a shallow clone)")
    log = git("log", "--format=%h %s", f"{RULE_SINCE}..HEAD")
    assert log.returncode == 0, log.stderr
    too_long = [line for line in log.stdout.splitlines() if len(line.split(" ", 1)[1]) > MAX_SUBJECT]
    assert not too_long, f"commit subjects over {MAX_SUBJECT} characters: {too_long}"
