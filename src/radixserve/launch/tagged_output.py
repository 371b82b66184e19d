"""Output of the local stack with each line tagged by the process that wrote it: ``router | ...``, ``engine-0 | ...``.

How: the supervisor gives each engine child one pipe for its stdout and stderr together, and a reader thread per
child (``TaggedOutput.start_pump``) writes every line it reads to this process's stderr with the child's tag. In
this process (the router's), ``TaggedOutput.tag_this_process`` swaps ``sys.stdout`` / ``sys.stderr`` (and the root
logging handlers that write to them) for ``TaggedWriter``s, which buffer partial writes and emit whole tagged lines.

Why pipes and not a tag in each process's log format (passed through the environment): a format tags only what goes
through ``logging`` with that format, and misses an engine's crash traceback (printed by the interpreter), uvicorn's
own lines (uvicorn installs its own handlers and formats) and anything a library prints. A pipe sees every byte.

What keeps it sound:

- A line is written whole, under one lock shared by every writer (reader threads and this process's own streams),
  and flushed at once: two processes' lines never interleave mid-line. A line longer than ``MAX_LINE_BYTES`` is
  written in pieces of that size, each tagged (memory stays bounded whatever a child writes).
- A reader never stops reading before end of file: bytes that are not UTF-8 are replaced, and a write that fails (a
  closed terminal, a broken pipe) drops the line and goes on, so a child never blocks on a full pipe because its
  reader died. A child blocks only while this process's stderr itself blocks, as it would writing there directly.
- A reader ends at end of file, i.e. with the child (and anything that inherited its output); the supervisor joins it
  after the child exits, so a crashed engine's traceback is written before the supervisor's line about the exit.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
from collections.abc import Iterator
from typing import IO, TextIO

ROUTER_TAG = "router"
MAX_LINE_BYTES = 64 * 1024  # longer lines are written in pieces of this size, each tagged


def engine_tag(i: int) -> str:
    """The tag of engine ``i``'s lines: ``engine-0``, ``engine-1``, ..."""
    return f"engine-{i}"


class TaggedOutput:
    """Whole lines to ``stream`` (default: this process's stderr now), each as ``TAG | line``, under one lock.

    ``tag_width``: tags are padded to this many characters, so the lines of the stack's processes align."""

    def __init__(self, stream: TextIO | None = None, tag_width: int = 0):
        self.stream = sys.stderr if stream is None else stream
        self.tag_width = tag_width
        self._lock = threading.Lock()

    def write_lines(self, tag: str, lines: list[str], stream: TextIO | None = None) -> None:
        """Write each of ``lines`` (without or with its newline) to ``stream`` (default ``self.stream``) as
        ``TAG | line``, all under the lock (a multi-line traceback stays together), and flush. Raises what the
        stream's write raises (OSError; ValueError when it is closed)."""
        prefix = tag.ljust(self.tag_width) + " | "
        text = "".join(prefix + line + ("" if line.endswith("\n") else "\n") for line in lines)
        out = self.stream if stream is None else stream
        with self._lock:
            out.write(text)
            out.flush()

    def pump(self, pipe: IO[bytes], tag: str) -> None:
        """Read ``pipe`` to end of file and write each line with ``tag``; close ``pipe``. Never raises: a line that
        cannot be written is dropped, and reading goes on (a child must never block on a full pipe)."""
        try:
            for raw in iter(lambda: pipe.readline(MAX_LINE_BYTES), b""):
                try:
                    self.write_lines(tag, [raw.decode("utf-8", errors="replace")])
                except (OSError, ValueError):
                    pass  # our stderr is gone (terminal closed, pipe broken): keep draining the child
        except (OSError, ValueError):  # pragma: no cover - the pipe itself failed
            pass
        finally:
            with contextlib.suppress(OSError):
                pipe.close()

    def start_pump(self, pipe: IO[bytes], tag: str) -> threading.Thread:
        """``pump(pipe, tag)`` in a daemon thread (so a child's descendant holding the pipe open never holds up
        this process's exit); returns the started thread, which ends at the pipe's end of file."""
        thread = threading.Thread(target=self.pump, args=(pipe, tag), name=f"radixserve-output-{tag}", daemon=True)
        thread.start()
        return thread

    def writer(self, tag: str, stream: TextIO) -> TaggedWriter:
        """A text stream that writes to ``stream`` in whole lines tagged ``tag``, under this output's lock."""
        return TaggedWriter(self, tag, stream)

    @contextlib.contextmanager
    def tag_this_process(self, tag: str) -> Iterator[None]:
        """Within the block, everything this process writes to ``sys.stdout`` / ``sys.stderr`` (print, tracebacks,
        logging handlers created meanwhile, such as uvicorn's, and the root logging handlers that write there
        already) goes out in whole lines tagged ``tag``. Restores the streams and handlers on exit, after writing
        what is left of a partial line."""
        old_out, old_err = sys.stdout, sys.stderr
        new_out, new_err = self.writer(tag, old_out), self.writer(tag, old_err)
        swapped: list[tuple[logging.StreamHandler[TextIO], TextIO]] = []
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler and handler.stream in (old_out, old_err):
                stream = handler.stream
                handler.setStream(new_out if stream is old_out else new_err)
                swapped.append((handler, stream))
        sys.stdout, sys.stderr = new_out, new_err
        try:
            yield
        finally:
            sys.stdout, sys.stderr = old_out, old_err
            for handler, stream in swapped:
                handler.setStream(stream)
            for w in (new_out, new_err):
                with contextlib.suppress(OSError, ValueError):
                    w.flush_partial()


class TaggedWriter(io.TextIOBase):
    """A text stream for one process's ``sys.stdout`` or ``sys.stderr``: buffers what is written until a newline,
    then writes each whole line through ``output`` as ``TAG | line`` to ``stream``. A partial line longer than
    ``MAX_LINE_BYTES`` characters is written as it stands; ``flush_partial`` writes what is left."""

    def __init__(self, output: TaggedOutput, tag: str, stream: TextIO):
        super().__init__()
        self.output = output
        self.tag = tag
        self.stream = stream
        self._partial = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        with self._lock:  # threads of this process (event loop, supervisor) share the partial line
            lines = (self._partial + s).split("\n")
            self._partial = lines.pop()
            if len(self._partial) > MAX_LINE_BYTES:
                lines.append(self._partial)
                self._partial = ""
            if lines:
                self.output.write_lines(self.tag, lines, self.stream)
        return len(s)

    def flush(self) -> None:
        # Nothing to do: whole lines are flushed as they are written (under the lock, unlike a flush from here that
        # would race a reader thread's write), and a partial line waits for its newline.
        pass

    def flush_partial(self) -> None:
        """Write the buffered partial line, if any, as a line of its own."""
        with self._lock:
            rest, self._partial = self._partial, ""
            if rest:
                self.output.write_lines(self.tag, [rest], self.stream)

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", None) or "utf-8"
