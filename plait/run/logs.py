"""Where output goes: each worker's lines to the console with its rank, to files, or both.

    worker stdout/stderr ─pipe─▶ LogPump thread ─┬─▶ console: b"[rank 5] " + line  (unless filtered out)
                                                 └─▶ <run dir>/attempt_<N>/rank_<R>/stdout.log   (--tee)
    --redirects: the worker writes straight into its file: no pipe, nothing on the console
    the agent's own messages: "[plait run] ..." on stderr (PLAIT_LOG_LEVEL, default INFO)

Lines are written whole, so two ranks never interleave inside a line; a partial line (a prompt,
a progress bar) is shown after 0.1 s without a newline and continued without a second prefix,
unless another rank writes to that console first: then the partial line is ended there, and its
rest comes on a line of its own (prefixed; a lone newline that would end it is dropped).
The prefix carries the global rank, and the node's name once there is more than one node
(pytorch#60911: torchrun's `[default0]:` is the same on every node).
"""

from __future__ import annotations

import os
import selectors
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from string import Template
from typing import BinaryIO

from plait.run.config import LaunchError, LogConfig

_console_lock = threading.Lock()
_IDLE_FLUSH = 0.1
_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}


def write_console(stream: BinaryIO, data: bytes) -> None:
    with _console_lock:
        try:
            stream.write(data)
            stream.flush()
        except (BrokenPipeError, ValueError):
            pass  # the console went away (closed pipe); the job goes on


class AgentLog:
    """The launcher's own messages on stderr, one line each."""

    def __init__(self) -> None:
        self.node: str | None = None  # set once the job has more than one node
        self._level = _LEVELS.get(os.environ.get("PLAIT_LOG_LEVEL", "INFO").upper(), 20)

    def _write(self, level: int, msg: str) -> None:
        if level < self._level:
            return
        tag = f"[plait run {self.node}]" if self.node else "[plait run]"
        text = "\n".join(f"{tag} {line}" if i == 0 else line for i, line in enumerate(msg.splitlines()))
        write_console(sys.stderr.buffer, (text + "\n").encode(errors="replace"))

    def debug(self, msg: str) -> None:
        self._write(10, msg)

    def info(self, msg: str) -> None:
        self._write(20, msg)

    def warning(self, msg: str) -> None:
        self._write(30, msg)

    def error(self, msg: str) -> None:
        self._write(40, msg)


class RunDir:
    """A job's files: --log-dir (kept), or a temporary directory kept only if something needs it."""

    def __init__(self, logs: LogConfig):
        if logs.log_dir:
            try:
                os.makedirs(logs.log_dir, exist_ok=True)
            except OSError as e:
                raise LaunchError(f"--log-dir {logs.log_dir!r}: {e.strerror}") from None
            self.path, self.temporary = os.path.abspath(logs.log_dir), False
        else:
            self.path, self.temporary = tempfile.mkdtemp(prefix="plait-run-"), True
        self.has_logs = False  # some stream went to a file: never delete those

    def rank_dir(self, round: int, global_rank: int) -> str:
        path = os.path.join(self.path, f"attempt_{round}", f"rank_{global_rank}")
        os.makedirs(path, exist_ok=True)
        return path

    def cleanup(self, *, succeeded: bool) -> None:
        """Remove a temporary directory after a success; after a failure it holds the error files."""
        if not self.temporary or self.has_logs:
            return
        if succeeded or not any(files for _, _, files in os.walk(self.path)):
            shutil.rmtree(self.path, ignore_errors=True)


def line_prefix(template: str | None, *, rank: int, local_rank: int, role: str, node: str, multi_node: bool) -> bytes:
    if template is None:
        template = "[${node} rank ${rank}] " if multi_node else "[rank ${rank}] "
    text = Template(template).safe_substitute(rank=rank, local_rank=local_rank, role_name=role, node=node)
    return text.encode()


@dataclass(eq=False)
class _Stream:
    fd: int
    prefix: bytes
    console: BinaryIO | None
    file: BinaryIO | None
    partial: bytearray = field(default_factory=bytearray)
    partial_since: float = 0.0
    midline: bool = False  # the console got part of a line: the rest continues it, unprefixed
    cut: bool = False  # its open line was ended for it (another rank wrote): drop the newline that ends it


class LogPump:
    """One thread that moves every worker's output of one round to the console and files."""

    def __init__(self, on_eof: Callable[[], None]):
        self._streams: dict[int, _Stream] = {}
        self._open: dict[int, _Stream] = {}  # id(console) -> the stream whose partial line it shows
        self._on_eof = on_eof
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="plait-logs", daemon=True)

    def add(self, fd: int, *, prefix: bytes, console: BinaryIO | None, file: BinaryIO | None) -> None:
        """Own `fd` (a pipe's read end) from now on; call before start()."""
        self._streams[fd] = _Stream(fd, prefix, console, file)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` for every pipe to close, then stop reading (a stray grandchild may hold one)."""
        if self._thread.ident is None:  # never started: a worker failed to spawn
            self._thread = threading.Thread(target=self._run, daemon=True)
            os.write(self._stop_w, b"\0")
            self._thread.start()  # runs its cleanup and returns at once
        self._thread.join(timeout)
        os.write(self._stop_w, b"\0")
        self._thread.join(timeout)
        if not self._thread.is_alive():  # else it is stuck writing to a console nobody reads
            os.close(self._stop_r)
            os.close(self._stop_w)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._stop_r, selectors.EVENT_READ)
        for fd in self._streams:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        try:
            while self._streams:
                pending = [s for s in self._streams.values() if s.partial]
                timeout = None
                if pending:
                    timeout = max(0.0, min(s.partial_since for s in pending) + _IDLE_FLUSH - time.monotonic())
                for key, _ in sel.select(timeout=timeout):
                    if key.fd == self._stop_r:
                        return
                    self._read(sel, self._streams[key.fd])
                now = time.monotonic()
                for s in self._streams.values():
                    if s.partial and now - s.partial_since >= _IDLE_FLUSH:
                        self._flush_partial(s)
        finally:
            for s in list(self._streams.values()):
                self._close(sel, s)
            sel.close()

    def _read(self, sel: selectors.BaseSelector, s: _Stream) -> None:
        try:
            data = os.read(s.fd, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            self._close(sel, s)
            self._on_eof()
            return
        if s.file is not None:
            s.file.write(data)
            s.file.flush()
        if s.console is None:
            return
        if not s.partial:
            s.partial_since = time.monotonic()
        s.partial += data
        cut = s.partial.rfind(b"\n") + 1
        if cut:
            self._to_console(s, bytes(s.partial[:cut]))
            del s.partial[:cut]
            s.partial_since = time.monotonic()

    def _flush_partial(self, s: _Stream) -> None:
        if s.partial and s.console is not None:
            self._to_console(s, bytes(s.partial))
            s.partial.clear()

    def _to_console(self, s: _Stream, chunk: bytes) -> None:
        out = bytearray()
        console = id(s.console)
        owner = self._open.pop(console, None)
        if owner is not None and owner is not s:  # another rank's partial line is open there: end it
            out += b"\n"
            owner.midline, owner.cut = False, True
        if s.cut:  # its line was ended for it: the newline that ends it is already out
            s.cut = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        start = 0
        while start < len(chunk):
            end = chunk.find(b"\n", start) + 1 or len(chunk)
            if not (start == 0 and s.midline):
                out += s.prefix
            out += chunk[start:end]
            start = end
        if chunk:
            s.midline = not chunk.endswith(b"\n")
        if s.midline:
            self._open[console] = s
        if out:
            write_console(s.console, bytes(out))

    def _close(self, sel: selectors.BaseSelector, s: _Stream) -> None:
        self._flush_partial(s)
        if s.midline and s.console is not None:
            write_console(s.console, b"\n")
            self._open.pop(id(s.console), None)
        sel.unregister(s.fd)
        os.close(s.fd)
        if s.file is not None:
            s.file.close()
        del self._streams[s.fd]
