"""Worker failures: what a failing worker leaves behind, and how the launcher reports it.

    worker raises ──@record / bootstrap excepthook──▶ error.json (torch's TORCHELASTIC_ERROR_FILE format)
    worker exits ≠ 0 ──agent──▶ Failure (exit code or signal, error file, traceback)
    first Failure of the job ──RoundEnd──▶ every agent's exit summary

A `Failure` travels between nodes as JSON inside the round's end record, so the summary every
node prints names the job's first failure — its rank, node, exit code or signal, time and
traceback — not just the failures that happened to be local.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ParamSpec, TypeVar

from plait.run.bootstrap import write_error_file

_P = ParamSpec("_P")
_R = TypeVar("_R")

# A traceback is carried in the store and printed by every node: keep its tail, where the error is.
_MAX_TRACEBACK_CHARS = 16_000


def record(fn: Callable[_P, _R], error_handler: Any = None) -> Callable[_P, _R | None]:
    """Write an exception escaping `fn` to the worker's error file, then re-raise it (torch's `@record`).

    Under `plait run` the bootstrap's excepthook already does this for uncaught exceptions; the
    decorator keeps scripts written for torchrun working unchanged and also covers workers
    started with `--no-python`. As in torch: `SystemExit(0)` returns None, another exit code is
    re-raised untouched (the script's own report); a `ChildFailedError` (a parent whose children
    failed) copies the first child's error file into this process's, so the launcher names the
    child's traceback, not the parent's. `error_handler` is torch's hook object
    (`initialize()`, `record_exception(e)`, `dump_error_file(path, exitcode)`); None writes the
    file plait's launcher named.
    """
    from plait.run.child_failure import ChildFailedError, dump_child_error_file

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        if error_handler is not None:
            error_handler.initialize()
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:
            if e.code == 0:
                return None
            raise
        except ChildFailedError as e:
            _, failure = e.get_first_failure()
            if error_handler is not None:
                if failure.error_file != "<N/A>":
                    error_handler.dump_error_file(failure.error_file, failure.exitcode)
            else:
                dump_child_error_file(failure)
            raise
        except Exception as e:
            if error_handler is not None:
                error_handler.record_exception(e)
            else:
                write_error_file(e)
            raise

    return wrapper


def signal_name(exitcode: int) -> str | None:
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


@dataclass(frozen=True)
class Failure:
    """One worker that exited non-zero (or by a signal) before the agent stopped it."""

    global_rank: int
    local_rank: int
    group_rank: int
    node: str
    pid: int
    exitcode: int  # negative: killed by signal -exitcode
    timestamp: float
    error_file: str | None  # None: the worker wrote none
    message: str
    traceback: str

    @classmethod
    def from_exit(
        cls, *, global_rank: int, local_rank: int, group_rank: int, node: str, pid: int,
        exitcode: int, error_file: str,
    ) -> Failure:
        data = _read_error_file(error_file)
        if data is None:
            sig = signal_name(exitcode)
            message = f"killed by {sig}" if sig else f"exited with code {exitcode}"
            return cls(global_rank, local_rank, group_rank, node, pid, exitcode, time.time(), None, message, "")
        message, tb, ts = data
        if len(tb) > _MAX_TRACEBACK_CHARS:
            tb = "...\n" + tb[-_MAX_TRACEBACK_CHARS:]
        return cls(global_rank, local_rank, group_rank, node, pid, exitcode, ts, error_file, message, tb)

    def headline(self) -> str:
        sig = signal_name(self.exitcode)
        how = f"was killed by {sig}" if sig else f"exited with code {self.exitcode}"
        return f"rank {self.global_rank} (node {self.node}, local rank {self.local_rank}) {how}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Failure:
        return cls(**data)


def _read_error_file(path: str) -> tuple[str, str, float] | None:
    """(message, traceback, timestamp) from a torch-format error file, or None if there is none."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    msg = data.get("message")
    if isinstance(msg, str):  # the flat form torch also accepts
        return msg, "", float(data.get("timestamp", time.time()))
    if not isinstance(msg, dict):
        return None
    extra = msg.get("extraInfo", {})
    return str(msg.get("message", "")), str(extra.get("py_callstack", "")), float(extra.get("timestamp", time.time()))


def _indent(text: str, pad: str) -> str:
    return "\n".join(pad + line for line in text.rstrip("\n").splitlines())


def format_failure(f: Failure) -> str:
    sig = signal_name(f.exitcode)
    exit_text = f"{f.exitcode} ({sig})" if sig else str(f.exitcode)
    lines = [
        f"  time      : {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(f.timestamp))}",
        f"  node      : {f.node} (group rank {f.group_rank})",
        f"  rank      : {f.global_rank} (local rank {f.local_rank})",
        f"  exitcode  : {exit_text} (pid {f.pid})",
        f"  error_file: {f.error_file or '<none>'}",
        f"  message   : {f.message}",
    ]
    if f.traceback:
        lines += ["  traceback :", _indent(f.traceback, "    ")]
    return "\n".join(lines)


def format_summary(title: str, root_cause: str, others: list[Failure]) -> str:
    """The block the launcher prints when the job fails for good (torchrun's ChildFailedError layout)."""
    rule = "=" * 72
    parts = [rule, title, "-" * 72, "Root cause (first observed failure):", root_cause]
    if others:
        parts += ["-" * 72, "Other failures on this node:"]
        parts += [f"  {f.headline()}: {f.message}" for f in others]
    parts.append(rule)
    return "\n".join(parts)
