"""``radixserve up``'s engine supervisor (launch/local_stack.py) with stand-in child processes: restart back-off and
its reset, the children's environment, and stopping."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from radixserve.launch.local_stack import ENGINE_ENV, EngineSupervisor, engine_env

from fake_engine import wait_until

EXITS_AT_ONCE = [sys.executable, "-c", "import sys; sys.exit(1)"]


def restart_delays(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The delays of the supervisor's "engine 0 exited ...; restarting in D s" warnings, in order."""
    return [
        float(r.args[2])  # type: ignore[index]
        for r in caplog.records
        if r.name == "radixserve.up" and r.getMessage().startswith("engine 0 exited")
    ]


def test_restart_back_off_doubles_up_to_its_cap(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.up")
    sup = EngineSupervisor(
        [EXITS_AT_ONCE], backoff_s=0.05, max_backoff_s=0.2, reset_after_s=30.0, poll_s=0.02, max_failed_starts=None
    )
    sup.start()
    try:
        assert wait_until(lambda: len(restart_delays(caplog)) >= 5, 30)
    finally:
        sup.stop()
    assert restart_delays(caplog)[:5] == [0.05, 0.1, 0.2, 0.2, 0.2]


def test_restart_back_off_resets_once_an_engine_stayed_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Regression: the back-off only ever doubled, so after five crashes at any time in the stack's life every later
    # crash waited 30 s. Runs 1-3 exit at once; run 4 stays up longer than reset_after_s, then exits; so do later ones.
    caplog.set_level(logging.INFO, logger="radixserve.up")
    counter = tmp_path / "runs"
    script = (
        "import pathlib, sys, time\n"
        "p = pathlib.Path(sys.argv[1]); n = int(p.read_text() or 0) + 1 if p.exists() else 1; p.write_text(str(n))\n"
        "time.sleep(1.2 if n >= 4 else 0)\n"
        "sys.exit(1)\n"
    )
    argv = [sys.executable, "-c", script, str(counter)]
    # max_failed_starts=4: three failed starts in a row are not yet enough to give up, and the count starts over too.
    sup = EngineSupervisor(
        [argv], backoff_s=0.05, max_backoff_s=0.4, reset_after_s=0.8, poll_s=0.02, max_failed_starts=4
    )
    sup.start()
    try:
        assert wait_until(lambda: len(restart_delays(caplog)) >= 5, 60)
    finally:
        sup.stop()
    delays = restart_delays(caplog)
    assert delays[:3] == [0.05, 0.1, 0.2]  # a crash loop backs off...
    assert delays[3:5] == [0.05, 0.05]  # ...an engine that had stayed up starts over, each time
    assert sup.failure is None


def test_an_engine_that_never_comes_up_is_given_up_after_max_failed_starts(caplog: pytest.LogCaptureFixture) -> None:
    # Regression: `radixserve up` with an engine that could not start restarted it forever (hundreds of log lines)
    # behind a router answering 503.
    caplog.set_level(logging.INFO, logger="radixserve.up")
    gave_up: list[str | None] = []
    sup = EngineSupervisor(
        [[sys.executable, "-c", "import sys; sys.exit(3)"]],
        backoff_s=0.02,
        reset_after_s=30.0,
        poll_s=0.02,
        max_failed_starts=3,
        on_give_up=lambda: gave_up.append(sup.failure),
    )
    sup.start()
    try:
        assert wait_until(lambda: bool(gave_up), 30)
        time.sleep(0.3)  # no restart after giving up
    finally:
        sup.stop()
    expected = "engine 0 failed to start 3 times in a row; last exit status 3; see its output above"
    assert gave_up == [expected] and sup.failure == expected
    assert len(restart_delays(caplog)) == 2  # started 3 times: restarted twice, then given up
    assert any(r.levelno == logging.ERROR and r.getMessage() == expected for r in caplog.records)


def test_engine_children_get_progress_bars_off_and_keep_the_rest_of_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_TEST_MARK", "kept")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # a user's own setting wins
    out = tmp_path / "env"
    script = (
        "import os, sys\n"
        "keys = ('TQDM_DISABLE', 'HF_HUB_DISABLE_PROGRESS_BARS', 'RADIXSERVE_TEST_MARK')\n"
        "open(sys.argv[1], 'w').write(' '.join(f'{k}={os.environ.get(k)}' for k in keys))\n"
        "import time; time.sleep(30)\n"
    )
    sup = EngineSupervisor([[sys.executable, "-c", script, str(out)]], grace_s=5)
    sup.start()
    try:
        assert wait_until(lambda: out.exists() and out.read_text(), 30)
    finally:
        sup.stop()
    assert out.read_text() == "TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=0 RADIXSERVE_TEST_MARK=kept"
    assert "TQDM_DISABLE" not in os.environ  # this process (and a standalone engine) keeps its progress bars
    assert engine_env({}) == ENGINE_ENV


def test_the_api_key_is_set_or_removed_in_the_engine_environment() -> None:
    # The engines read RADIXSERVE_API_KEY (their --api-key default); `up` hands them its own key that way, so a stale
    # value in this process's environment never outlives an explicit --api-key, nor reaches keyless engines.
    base = {"RADIXSERVE_API_KEY": "stale", "PATH": "/bin"}
    assert engine_env(base, api_key="k")["RADIXSERVE_API_KEY"] == "k"
    assert "RADIXSERVE_API_KEY" not in engine_env(base, api_key=None)
    assert "RADIXSERVE_API_KEY" not in engine_env(base, api_key="")
    assert engine_env(base)["PATH"] == "/bin" and engine_env(base)["PYTHONUNBUFFERED"] == "1"


def test_progress_bars_are_silent_under_the_engine_environment() -> None:
    # What the engines' "Loading weights" bar (transformers' tqdm) and huggingface_hub's bars honour.
    import subprocess

    code = (
        "from tqdm import tqdm\n"
        "from huggingface_hub.utils import tqdm as hf_tqdm\n"
        "from transformers.utils.logging import tqdm as tf_tqdm\n"
        "for bar in (tqdm, hf_tqdm, tf_tqdm):\n"
        "    list(bar(range(3), desc='Loading weights'))\n"
    )
    quiet = subprocess.run([sys.executable, "-c", code], env=engine_env(), capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "Loading weights" not in quiet.stderr + quiet.stdout
    env = {k: v for k, v in os.environ.items() if k not in ENGINE_ENV}
    loud = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert loud.stderr.count("Loading weights") >= 3  # without it every bar shows (so the check above means something)


def test_a_second_interrupt_while_stopping_kills_the_engines_at_once(tmp_path: Path) -> None:
    # An engine that ignores SIGTERM would hold stop() for grace_s; Ctrl-C again (a KeyboardInterrupt) kills it.
    ready = tmp_path / "ready"
    script = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "pathlib.Path(sys.argv[1]).write_text('x')\n"
        "time.sleep(60)\n"
    )
    sup = EngineSupervisor([[sys.executable, "-c", script, str(ready)]], grace_s=30)
    sup.start()
    assert wait_until(ready.exists, 30)
    proc = sup.procs[0]
    assert proc is not None

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            sup.stop()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - t0 < 10
    assert proc.returncode == -signal.SIGKILL


def test_a_killed_engine_is_described_by_its_signal():
    """Regression: an engine killed with SIGKILL was logged as "exited with status -9"."""
    import signal
    import subprocess
    import sys

    from radixserve.launch.local_stack import describe_exit

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.send_signal(signal.SIGKILL)
    assert describe_exit(child.wait(timeout=10)) == "was killed by SIGKILL"
    assert describe_exit(1) == "exited with status 1" and describe_exit(0) == "exited with status 0"
