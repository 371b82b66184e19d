"""An engine's start-up, as the newcomer trial after round 1 of issue 11 saw it: the listening socket bound before the
model loads (item 10), progress bars only on a terminal (item 2), a stop during the warm-up (item 4), the context
length and where it comes from (item 5), the KV pool line and ``--help`` defaults (item 12). No real model is loaded:
a tiny random checkpoint with the demo tokenizer (tests/tiny_model.py), whose ``max_position_embeddings`` is 8192 as
the demo model's."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import pty
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from radixserve.engine.config import EngineArgs
from radixserve.engine.context_length import (
    ALLOW_LONGER_CONTEXT_ENV,
    check_context_length,
    minimal_chat_tokens,
    served_context,
)
from radixserve.engine.progress import progress_bars_enabled
from radixserve.launch.cli import main

from conftest import ROOT, free_port
from tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=8192)


def child_env(**extra: str) -> dict[str, str]:
    """This environment without the variables that switch progress bars off, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def engine_cmd(model: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "radixserve", "engine", "--model-path", model, "--device", "cpu", *flags]


@pytest.fixture
def busy_port():
    """A port some other server listens on, for the test's duration."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


# ---------------------------------------------------------------------------- item 10: bind before loading


def test_engine_on_a_port_in_use_exits_2_at_once_before_loading(tiny_model, busy_port, capsys, caplog):
    # Regression: `engine --port 2024` (in use) loaded the model, logged "serving ... on http://127.0.0.1:2024",
    # then failed with exit status 3 after 6-19 s.
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO):
        status = main(["engine", "--model-path", tiny_model, "--port", str(busy_port)])
    assert status == 2
    assert time.monotonic() - t0 < 1.0
    err = capsys.readouterr().err
    where = f"127.0.0.1:{busy_port}"
    assert err == f"radixserve engine: --port {busy_port}: {where} is already in use (another server listens there)\n"
    assert "loading" not in caplog.text and "serving" not in caplog.text  # nothing loaded, no misleading line


def test_engine_on_a_host_that_does_not_resolve_exits_2_in_one_line_before_loading(tiny_model):
    t0 = time.monotonic()
    proc = subprocess.run(
        engine_cmd(tiny_model, "--host", "nosuchhost.invalid", "--port", "0"),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("radixserve engine: --host nosuchhost.invalid: cannot resolve it (")
    assert len(proc.stderr.strip().splitlines()) == 1  # no "loading ...", no weights bar, no traceback
    assert time.monotonic() - t0 < 15  # a Python start-up (the old engine loaded the model first: exit 3)


def test_router_on_a_port_in_use_exits_2_without_saying_it_serves(busy_port, capsys, caplog):
    # Regression: the router logged "router serving on http://127.0.0.1:2024" before "[Errno 98] address already
    # in use" and exit status 3.
    with caplog.at_level(logging.INFO):
        status = main(["router", "--worker-urls", "http://127.0.0.1:9", "--port", str(busy_port)])
    assert status == 2
    assert capsys.readouterr().err.startswith(f"radixserve router: --port {busy_port}: 127.0.0.1:{busy_port} is")
    assert "serving" not in caplog.text


# --------------------------------------------------- items 2 and 4: a real engine process, its log and Ctrl-C


def test_sigint_during_warm_up_is_a_clean_stop_and_the_log_has_no_progress_bar(tiny_model, tmp_path):
    # Regression (item 4): SIGINT right after the port opened, during the warm-up forward, logged "ERROR
    # radixserve.engine.server: engine failed to start ... RuntimeError: cannot schedule new futures after shutdown"
    # with a traceback. Regression (item 2): `radixserve engine ... > file` wrote the tqdm bar "Loading weights:
    # 82%|...| 224/272" into the file (only `radixserve up` set TQDM_DISABLE).
    port = free_port()
    log_path = tmp_path / "engine.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            engine_cmd(tiny_model, "--port", str(port), "--max-total-tokens", "4096", "--num-threads", "1"),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=child_env(),
        )
        try:
            deadline = time.monotonic() + 120
            while "Application startup complete" not in log_path.read_text():  # the warm-up starts here
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert "ERROR" not in text and "Traceback" not in text and "cannot schedule" not in text, text
    assert "Loading weights" not in text and "%|" not in text and "\r" not in text
    assert "loading" in text  # the engine did start


def test_a_shutdown_during_the_warm_up_keeps_the_loop_unstarted(tiny_model, caplog):
    from radixserve.engine.engine import Engine

    engine = Engine(EngineArgs(model_path=tiny_model, device="cpu", dtype="float32", max_total_tokens=256))
    in_warmup, release = threading.Event(), threading.Event()
    warmup = engine.runner.warmup

    def slow_warmup() -> None:
        in_warmup.set()
        release.wait(30)
        warmup()

    engine.runner.warmup = slow_warmup  # type: ignore[method-assign]
    errors: list[BaseException] = []

    def start() -> None:
        try:
            engine.start()
        except BaseException as e:  # the regression: RuntimeError from the closed executor
            errors.append(e)

    starter = threading.Thread(target=start)
    with caplog.at_level(logging.INFO, logger="radixserve.engine.engine"):
        starter.start()
        assert in_warmup.wait(30)
        engine.shutdown()  # Ctrl-C / SIGTERM: the server's on_exit hook
        release.set()
        starter.join(30)
    assert errors == [] and not starter.is_alive()
    assert not engine.is_healthy() and not engine.scheduler.alive
    assert "engine stopped during its warm-up; it served no request" in caplog.text


def test_a_shutdown_before_the_start_is_quiet_too(tiny_model, caplog):
    from radixserve.engine.engine import Engine

    engine = Engine(EngineArgs(model_path=tiny_model, device="cpu", dtype="float32", max_total_tokens=256))
    engine.shutdown()
    with caplog.at_level(logging.INFO, logger="radixserve.engine.engine"):
        engine.start()
    assert not engine.is_healthy()
    assert "engine stopped before its warm-up" in caplog.text


# --------------------------------------------------------------------- item 2: the progress-bar decision


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_bars_only_on_a_terminal_and_tqdm_disable_wins():
    assert progress_bars_enabled(_Stream(tty=True), environ={})
    assert not progress_bars_enabled(_Stream(tty=False), environ={})  # a file, a pipe, a pod's log
    assert not progress_bars_enabled(_Stream(tty=True), environ={"TQDM_DISABLE": "1"})
    assert progress_bars_enabled(_Stream(tty=True), environ={"TQDM_DISABLE": ""})  # empty: unset
    closed = io.StringIO()
    closed.close()  # isatty() raises ValueError
    assert not progress_bars_enabled(closed, environ={})


LOAD = """
import sys
from radixserve.engine.model.runner import ModelRunner
from radixserve.engine.progress import quiet_library_progress_bars
quiet_library_progress_bars()  # what Engine does first
ModelRunner(sys.argv[1], dtype="float32", device="cpu", max_total_tokens=64)
import huggingface_hub.utils
print("library bars off:", huggingface_hub.utils.are_progress_bars_disabled(), flush=True)
"""


def test_weight_loading_bar_and_library_bars_follow_stderr(tiny_model, tmp_path):
    # stderr to a file: no bar, and huggingface_hub's / transformers' bars off as well.
    with open(tmp_path / "err", "w+") as err:
        out = subprocess.run(
            [sys.executable, "-c", LOAD, tiny_model], stdout=subprocess.PIPE, stderr=err, text=True, env=child_env()
        ).stdout
        err.seek(0)
        assert "Loading weights" not in err.read()
    assert "library bars off: True" in out
    # stderr on a terminal (a pseudo-terminal here, 120 columns: tqdm draws nothing in 0): the bar is drawn, and
    # the libraries' bars stay on.
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", LOAD, tiny_model],
            stdout=subprocess.PIPE,
            stderr=follower,
            text=True,
            env=child_env(),
        )
        os.close(follower)
        terminal = b""
        while True:  # until the child closes the terminal (EIO), reading as it writes
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            terminal += chunk
        out = proc.communicate(timeout=120)[0]
    finally:
        os.close(leader)
    assert proc.returncode == 0
    assert b"Loading weights" in terminal and b"%|" in terminal
    assert "library bars off: False" in out


# -------------------------------------------------------------------------------- item 5: the context length


def test_context_length_above_the_models_limit_exits_2_naming_the_flag(tiny_model, capsys, monkeypatch):
    # Regression: `engine --context-length 100000` on a model with max_position_embeddings 8192 started (and, with
    # --max-total-tokens 20000, silently served a 20000-token context). SGLang refuses it too.
    monkeypatch.delenv(ALLOW_LONGER_CONTEXT_ENV, raising=False)
    flags = ["--context-length", "100000", "--max-total-tokens", "20000", "--device", "cpu", "--port", "0"]
    assert main(["engine", "--model-path", tiny_model, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "radixserve engine: --context-length 100000 is longer than the model's max_position_embeddings (8192)"
    )
    assert f"{ALLOW_LONGER_CONTEXT_ENV}=1" in err and len(err.strip().splitlines()) == 1


def test_a_longer_context_is_served_only_with_the_opt_in(caplog):
    with pytest.raises(ValueError, match="give at most 8192"):
        check_context_length(100000, 8192, environ={ALLOW_LONGER_CONTEXT_ENV: "0"})
    check_context_length(8192, 8192, environ={})  # the limit itself is fine
    check_context_length(None, 8192, environ={})
    with caplog.at_level(logging.WARNING):
        check_context_length(100000, 8192, environ={ALLOW_LONGER_CONTEXT_ENV: "1"})
    assert "allowed by RADIXSERVE_ALLOW_LONGER_CONTEXT=1: outputs past 8192 tokens may be wrong" in caplog.text
    served = served_context(100000, 8192, 200000, "rule")  # a pool that holds it: served as asked
    assert (served.tokens, served.source) == (100000, "--context-length")


def test_a_pool_smaller_than_the_context_cuts_it_with_a_warning_saying_how_to_fix_it(tiny_model, caplog):
    from radixserve.engine.engine import Engine

    with caplog.at_level(logging.INFO):
        engine = Engine(EngineArgs(model_path=tiny_model, device="cpu", dtype="float32", max_total_tokens=4096))
    assert engine.context_length == 4096
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING and "context cut" in r.getMessage())
    assert warning.getMessage().startswith(
        "context cut from 8192 tokens (the model's max_position_embeddings) to 4096: the KV pool holds 4096 tokens "
        "(--max-total-tokens 4096); for the full context give --max-total-tokens 8192 or more"
    )
    assert "--mem-fraction-static" in warning.getMessage()
    assert "context 4,096 tokens from the model's max_position_embeddings, cut to the KV pool" in caplog.text
    engine.shutdown()


def test_a_context_that_holds_no_chat_is_a_warning(tiny_model, caplog):
    # Regression: `--max-total-tokens 10` started with context 10 and every chat got a 400, with no WARNING.
    from radixserve.engine.engine import Engine

    with caplog.at_level(logging.WARNING):
        engine = Engine(EngineArgs(model_path=tiny_model, device="cpu", dtype="float32", max_total_tokens=10))
    need = minimal_chat_tokens(engine.tokenizer)
    assert need is not None and need > 10  # the demo template's system prompt alone is ~30 tokens
    assert f"context of 10 tokens is too short for a chat: the chat template makes a one-word message {need} " in (
        caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        roomy = Engine(EngineArgs(model_path=tiny_model, device="cpu", dtype="float32", context_length=256))
    assert roomy.context_length == 256 and "WARNING" not in caplog.text  # a context that was asked for: no cut
    engine.shutdown()
    roomy.shutdown()


# ------------------------------------------------------------------------- item 12: the KV pool line, --help


def test_the_kv_pool_line_reads_as_size_tokens_and_what_sized_it(tiny_model, caplog):
    from radixserve.engine.model.runner import ModelRunner

    with caplog.at_level(logging.INFO, logger="radixserve.engine.model.runner"):
        ModelRunner(tiny_model, dtype="float32", device="cpu", max_total_tokens=20000)
    # 2 layers x 2 KV heads x 16 dims x K and V x 4 bytes = 512 B per token; 20001 slots (slot 0 is the dummy)
    assert "KV pool: 10 MiB, 20,000 tokens at 512 B/token; sized by --max-total-tokens 20000" in caplog.text


def test_engine_help_states_the_defaults_of_warmup_and_preferred_sampling_params(capsys):
    with pytest.raises(SystemExit):
        main(["engine", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "run a warm-up forward pass before serving (default: on; --no-warmup skips it)" in out
    assert (
        "(default: none, so OpenAI's: temperature 1.0, top_p 1.0; radixserve up passes '{\"temperature\": 0.0}')" in out
    )


def test_the_contracts_page_documents_the_opt_in_and_the_bind_failure():
    with open(os.path.join(ROOT, "docs", "contracts.md")) as f:
        text = " ".join(f.read().split())
    assert f"`{ALLOW_LONGER_CONTEXT_ENV}=1`" in text and "`max_position_embeddings`" in text
    assert "`radixserve engine` and `radixserve router` bind `--host`/`--port` first" in text
    assert "Ctrl-C stops `radixserve engine` with exit status 0" in text


def test_a_tokenizer_larger_than_the_vocabulary_fails_at_start_up(tmp_path):
    # Regression: a 160-token GGUF served with SmolLM2's tokenizer (--tokenizer-path) started, then the first chat
    # crashed the scheduler (IndexError in the embedding) and the engine answered 503 to everything after.
    from radixserve.engine.engine import Engine

    path = write_tiny_model(tmp_path / "small-vocab", vocab_size=1000)
    with pytest.raises(ValueError, match="has 49,152 tokens, more than the model's vocabulary of 1,000"):
        Engine(EngineArgs(model_path=path, device="cpu", dtype="float32", max_total_tokens=256))
