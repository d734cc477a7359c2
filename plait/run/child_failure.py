"""torch's failure records for a nanny process: `ProcessFailure` and `ChildFailedError`.

    child exits != 0 ──ProcessFailure(local_rank, pid, exitcode, error_file)──▶ message, timestamp
    {global_rank: ProcessFailure} ──ChildFailedError(name, failures)──▶ raised by the parent
    parent's @record catches it ──▶ copies the first failure's error file into its own

The names, fields and message layout are torch's (torch.distributed.elastic.multiprocessing.errors),
so a script that launches its own children and reports them the torchrun way ports by changing
imports. plait's own agent reports through `plait.run.errors.Failure`, which also travels between
nodes; these are the user-facing records.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from plait.run.bootstrap import error_file_path
from plait.run.errors import signal_name

_NOT_AVAILABLE = "<N/A>"
_NO_ERROR_DATA: dict[str, Any] = {"message": "<NONE>"}

GlobalRank = int


@dataclass
class ProcessFailure:
    """A child that failed: its message and time come from its error file when it wrote one (torch's)."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    error_file_data: dict[str, Any] = field(init=False)
    message: Any = field(init=False)
    timestamp: int = field(init=False)

    def __post_init__(self) -> None:
        self.error_file_data = dict(_NO_ERROR_DATA)
        self.message = ""
        self.timestamp = int(time.time())
        if os.path.isfile(self.error_file):
            with open(self.error_file) as f:
                self.error_file_data = json.load(f)
            message = self.error_file_data["message"]
            if isinstance(message, str):
                self.timestamp = int(self.error_file_data.get("timestamp", 0))
            else:
                self.timestamp = int(message["extraInfo"]["timestamp"])
            self.message = message
        else:
            self.error_file = _NOT_AVAILABLE
        if not self.message:
            if self.exitcode < 0:
                self.message = f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
            else:
                self.error_file_data["errorTraits"] = {
                    "category": "system_terminated_error", "retryability": "False",
                }
                self.message = "To enable traceback, decorate the entry point with @record"

    def signal_name(self) -> str:
        return signal_name(self.exitcode) or _NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        """The failure's time as YYYY-MM-DD_HH:MM:SS."""
        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_")


class ChildFailedError(Exception):
    """Raised by a parent whose children failed; `@record` propagates the first child's error file as-is."""

    def __init__(self, name: str, failures: dict[GlobalRank, ProcessFailure]) -> None:
        if not failures:
            raise ValueError(f"ChildFailedError({name!r}) needs at least one failure, got none")
        self.name = name
        self.failures = failures
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[GlobalRank, ProcessFailure]:
        rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        title = f"{self.name} FAILED"
        root_rank, _ = self.get_first_failure()
        root, others, width = "", [], len(title)
        for idx, (rank, failure) in enumerate(self.failures.items()):
            text = _format_failure(idx, rank, failure)
            width = max(width, *(len(line) for line in text.split("\n")))
            if rank == root_rank:
                root = text
            else:
                others.append(text)
        width = min(width, 60)
        return "\n".join([
            "", boarder_delim * width, title, section_delim * width, "Failures:",
            "\n".join(others or ["  <NO_OTHER_FAILURES>"]), section_delim * width,
            "Root Cause (first observed failure):", root, boarder_delim * width,
        ])


def _format_failure(idx: int, rank: int, failure: ProcessFailure) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("extraInfo", {}).get("py_callstack", msg.get("message", _NOT_AVAILABLE)).replace("\n", "\n  ")
    sig = failure.signal_name()
    sig_text = f" ({sig})" if sig != _NOT_AVAILABLE else ""
    return "\n".join([
        f"[{idx}]:",
        f"  time      : {failure.timestamp_isoformat()}",
        f"  host      : {socket.getfqdn()}",
        f"  rank      : {rank} (local_rank: {failure.local_rank})",
        f"  exitcode  : {failure.exitcode} (pid: {failure.pid}) {sig_text}",  # torch's spacing, byte for byte
        f"  error_file: {failure.error_file}",
        f"  traceback : {msg}",
    ])


def dump_child_error_file(failure: ProcessFailure) -> bool:
    """Copy a failed child's error file to this process's own (torch's ErrorHandler.dump_error_file).

    Returns False when there is nothing to copy: the child wrote none, or no launcher named ours.
    """
    ours = error_file_path()
    if failure.error_file == _NOT_AVAILABLE or not ours:
        return False
    os.makedirs(os.path.dirname(ours) or ".", exist_ok=True)
    tmp = f"{ours}.tmp{os.getpid()}"
    shutil.copyfile(failure.error_file, tmp)
    os.replace(tmp, ours)
    return True
