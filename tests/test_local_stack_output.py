"""``radixserve up``'s output and secrets (launch/tagged_output.py, launch/local_stack.py) with stand-in engines:
every line tagged with its process, whole and in order, a crashed engine's traceback included; a child that never
blocks on its pipe; the API key in the engines' environment, never on their command line nor in a log line."""

from __future__ import annotations

import errno
import io
import json
import logging
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest

from radixserve.launch.local_stack import EngineSupervisor, engine_argv
from radixserve.launch.tagged_output import MAX_LINE_BYTES, TaggedOutput

from conftest import free_port
from fake_engine import wait_until

# Engine 0 writes to stdout and stderr, then crashes (the traceback is the interpreter's, outside logging).
CRASHES = (
    "import sys\n"
    "print('hello from stdout', flush=True)\n"
    "print('hello from stderr', file=sys.stderr, flush=True)\n"
    "raise RuntimeError('boom at start-up')\n"
)
# Engine 1 writes ~1 MB (many times a pipe's 64 KiB) and a line longer than MAX_LINE_BYTES, then waits.
FLOODS = (
    "import sys, time\n"
    "for n in range(20000):\n"
    "    sys.stdout.write(f'line {n} ' + 'x' * 40 + '\\n')\n"
    "sys.stdout.write('y' * 150000 + '\\n')\n"
    "print('done', flush=True)\n"
    "time.sleep(60)\n"
)


class _Snapshot(logging.Handler):
    """Records what ``stream`` held when each record was logged."""

    def __init__(self, stream: io.StringIO):
        super().__init__()
        self.stream = stream
        self.seen: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.getMessage(), self.stream.getvalue()))


def test_engine_lines_are_tagged_whole_and_in_order_with_a_crash_traceback() -> None:
    # Regression (issue 11): router and engine lines were interleaved with no tag of which process wrote them.
    out = io.StringIO()
    snapshot = _Snapshot(out)
    up_logger = logging.getLogger("radixserve.up")
    up_logger.addHandler(snapshot)
    sup = EngineSupervisor(
        [[sys.executable, "-c", CRASHES], [sys.executable, "-c", FLOODS]],
        grace_s=5,
        backoff_s=60,  # no restart within the test
        max_failed_starts=None,
        poll_s=0.05,
        output=TaggedOutput(out, tag_width=8),
    )
    sup.start()
    try:
        assert wait_until(lambda: "engine-1 | done\n" in out.getvalue(), 60)
        assert wait_until(lambda: any(m.startswith("engine 0 exited") for m, _ in snapshot.seen), 30)
    finally:
        sup.stop()
        up_logger.removeHandler(snapshot)
    lines = out.getvalue().splitlines()
    assert all(re.match(r"engine-[01] \| ", line) for line in lines), [ln[:80] for ln in lines if ln[:8] != "engine-"]
    engine0 = [line.removeprefix("engine-0 | ") for line in lines if line.startswith("engine-0 | ")]
    assert engine0[:3] == ["hello from stdout", "hello from stderr", "Traceback (most recent call last):"]
    assert engine0[-1] == "RuntimeError: boom at start-up"
    engine1 = [line.removeprefix("engine-1 | ") for line in lines if line.startswith("engine-1 | ")]
    assert engine1[:20000] == [f"line {n} " + "x" * 40 for n in range(20000)]  # none lost, split or mixed
    pieces = engine1[20000:-1]
    assert "".join(pieces) == "y" * 150000 and max(map(len, pieces)) == MAX_LINE_BYTES  # written in tagged pieces
    assert engine1[-1] == "done"
    # The supervisor's line about the crash comes after the crash's traceback.
    written_then = next(text for m, text in snapshot.seen if m.startswith("engine 0 exited"))
    assert "engine-0 | RuntimeError: boom at start-up\n" in written_then


class _BrokenStream(io.StringIO):
    def write(self, s: str) -> int:
        raise OSError(errno.EPIPE, "Broken pipe")


def test_a_child_never_blocks_on_its_pipe_when_our_output_is_broken() -> None:
    # The reader keeps draining the pipe when writing a line fails (a closed terminal, `| head` gone): a child writing
    # far more than a pipe holds still runs to its end instead of blocking on a full pipe forever.
    writes_2_mb = "import sys\nfor _ in range(2048):\n    sys.stdout.write('z' * 1023 + '\\n')\nsys.stdout.flush()\n"
    sup = EngineSupervisor(
        [[sys.executable, "-c", writes_2_mb]],
        backoff_s=60,
        max_failed_starts=None,
        output=TaggedOutput(_BrokenStream()),
    )
    sup.start()
    try:
        proc = sup.procs[0]
        assert proc is not None
        assert proc.wait(timeout=30) == 0
    finally:
        sup.stop()


def test_this_process_writes_whole_lines_tagged_router(monkeypatch: pytest.MonkeyPatch) -> None:
    # In the `up` process (the router's): print, partial writes, the root logging handler basicConfig made, and a
    # traceback printed outside logging all come out as whole lines tagged "router", between the engines' lines.
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    handler = logging.StreamHandler(err)  # what logging.basicConfig(stream=sys.stderr) installs
    root = logging.getLogger()
    root.addHandler(handler)
    output = TaggedOutput(err, tag_width=8)
    try:
        with output.tag_this_process("router"):
            print("one")
            sys.stderr.write("two, in ")
            sys.stderr.write("pieces\n")
            logging.getLogger("radixserve.router").warning("a log line")
            try:
                raise ValueError("shown by traceback.print_exc")
            except ValueError:
                traceback.print_exc()
            output.write_lines("engine-0", ["from an engine\n"])
            sys.stderr.write("three, no newline")
    finally:
        root.removeHandler(handler)
    assert sys.stdout is out and sys.stderr is err and handler.stream is err  # all restored
    assert out.getvalue() == "router   | one\n"
    lines = err.getvalue().splitlines()
    assert lines[:3] == [
        "router   | two, in pieces",
        "router   | a log line",
        "router   | Traceback (most recent call last):",
    ]
    assert lines[-3:] == [
        "router   | ValueError: shown by traceback.print_exc",
        "engine-0 | from an engine",
        "router   | three, no newline",  # a partial line, written when the block ends
    ]
    assert all(line.startswith(("router   | ", "engine-0 | ")) for line in lines)


def test_engine_argv_never_carries_the_api_key() -> None:
    # Regression (issue 11): `up --api-key` put the key on every engine's command line, visible to all in `ps`.
    from radixserve.engine.config import engine_args_from_namespace
    from radixserve.launch.cli import build_parser

    ns = build_parser().parse_args(["up", "--api-key", "sk-secret-1234"])
    argv = engine_argv(engine_args_from_namespace(ns), 30000, 1)
    assert "--api-key" not in argv and not any("sk-secret-1234" in a for a in argv)


# A stand-in engine: records its command line and the key in its environment, then waits to be stopped.
RECORDS = (
    "import json, os, sys, time\n"
    "json.dump({'argv': sys.argv, 'key': os.environ.get('RADIXSERVE_API_KEY')}, open(sys.argv[1] + '.tmp', 'w'))\n"
    "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize(
    ("flags", "key"),
    [([], "sk-from-env-1234"), (["--api-key", "sk-from-flag-5678"], "sk-from-flag-5678")],
    ids=["from-RADIXSERVE_API_KEY", "flag-wins"],
)
def test_up_hands_the_api_key_to_engines_in_their_environment_only(
    flags: list[str],
    key: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Regression (issue 11): `up --api-key` put the key on the engines' command lines (ps) and in the supervisor's
    # INFO line. Now: default from $RADIXSERVE_API_KEY, to the engines through their environment, in no log line.
    from radixserve.engine.config import engine_args_from_namespace
    from radixserve.launch import cli, local_stack
    from radixserve.router import app as router_app

    model = tmp_path / "model"  # passes the start-up path check; the stand-in engine never reads it
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    seen = tmp_path / "engine.json"
    real_engine_argv = local_stack.engine_argv

    def stand_in(args: Any, port: int, threads: int, cpus: str) -> list[str]:  # the real flags, another program
        return [sys.executable, "-c", RECORDS, str(seen), *real_engine_argv(args, port, threads, cpus)[1:]]

    routers: list[Any] = []

    def router(args: Any, **_: Any) -> int:  # the router in this process, stopped by Ctrl-C once the engine started
        routers.append(args)
        assert wait_until(seen.exists, 30)
        print("the router writes a line", file=sys.stderr)
        raise KeyboardInterrupt

    monkeypatch.setattr(local_stack, "engine_argv", stand_in)
    monkeypatch.setattr(router_app, "run_router", router)
    monkeypatch.setenv("RADIXSERVE_API_KEY", "sk-from-env-1234")
    caplog.set_level(logging.DEBUG)
    argv = ["up", "--engines", "1", "--port", str(free_port()), "--engine-base-port", str(free_port())]
    ns = cli.build_parser().parse_args([*argv, "--model-path", str(model), *flags])
    assert cli.run_up(engine_args_from_namespace(ns), ns) == 0  # a stop by Ctrl-C is a clean exit

    engine = json.loads(seen.read_text())
    assert engine["key"] == key
    assert "--api-key" not in engine["argv"] and not any(key in a for a in engine["argv"])
    assert routers[0].api_key == routers[0].engine_api_key == key  # the in-process router gets it as before
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine 0 started")]
    assert len(started) == 1 and "--port" in started[0]  # the command-line line is there, without the key
    assert not any(key in r.getMessage() for r in caplog.records)
    err = capsys.readouterr().err
    assert key not in err
    assert "router   | the router writes a line\n" in err
