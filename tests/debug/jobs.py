"""Start a scenario of scenarios.py as N real rank processes and collect what they did.

Real processes, not the test pool: the watchdog ends its process, and "no process left
hanging" is part of what the tests check. Every rank that outlives `limit_s` is killed and
reported as hanging. The ranks are forked by zygote.py, which has torch imported already
(1.5 CPU s a rank saved); a job that sets PYTHONPATH (a bootstrap's sitecustomize, read only
by a fresh interpreter) is exec'd as `python scenarios.py NAME`.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCENARIOS = Path(__file__).with_name("scenarios.py")
ZYGOTE = Path(__file__).with_name("zygote.py")
ROOT = Path(__file__).resolve().parents[2]
_zygote: list[subprocess.Popen] = []  # started on first use, ended with the test process


class Forked:
    """A rank forked by the zygote: the part of Popen's interface the jobs use."""

    def __init__(self, pid: int, status: Path):
        self.pid, self.status, self.returncode = pid, status, None

    def poll(self) -> int | None:
        if self.returncode is None and self.status.exists():
            self.returncode = int(self.status.read_text())
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # the zygote writes the exit code before it reaps: the pid is still ours
            os.kill(self.pid, signum)


def _fork(argv: list[str], env: dict[str, str], log: Path) -> Forked:
    if not _zygote or _zygote[0].poll() is not None:
        _zygote[:] = [subprocess.Popen([sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       cwd=ROOT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                                  "OMP_NUM_THREADS": "1"})]
        atexit.register(_zygote[0].stdin.close)  # EOF: the zygote exits
    zygote = _zygote[0]
    status = log.with_suffix(".exitcode")
    zygote.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(ROOT), "log": str(log),
                                   "status": str(status)}) + "\n")
    zygote.stdin.flush()
    reply = zygote.stdout.readline()
    if not reply:
        raise RuntimeError(f"the zygote exited with code {zygote.wait()} before forking a rank")
    return Forked(json.loads(reply)["pid"], status)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Job:
    procs: list[subprocess.Popen | Forked]
    logs: list[Path]
    started: float
    trace_dir: Path

    def wait(self, limit_s: float) -> JobResult:
        deadline = self.started + limit_s
        ended: dict[int, float] = {}
        while len(ended) < len(self.procs) and time.monotonic() < deadline:
            for rank, p in enumerate(self.procs):
                if rank not in ended and p.poll() is not None:
                    ended[rank] = time.monotonic() - self.started
            time.sleep(0.02)
        hanging = [r for r, p in enumerate(self.procs) if p.poll() is None]
        self.kill()
        outputs = [log.read_text(errors="replace") for log in self.logs]
        return JobResult([p.returncode for p in self.procs], outputs, ended, hanging, self.trace_dir)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)

    def signal(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signum)


@dataclass
class JobResult:
    returncodes: list[int]
    outputs: list[str]
    seconds: dict[int, float]  # rank -> when it exited, from the start of the job
    hanging: list[int]  # ranks that had to be killed
    trace_dir: Path

    def describe(self) -> str:
        return "\n".join(f"--- rank {r} (exit {c}) ---\n{o}" for r, (c, o) in enumerate(zip(self.returncodes, self.outputs)))


def start(scenario: str, world: int, tmp: Path, env: dict[str, str] | None = None) -> Job:
    port = free_port()
    trace_dir = tmp / "trace"
    procs, logs = [], []
    for rank in range(world):
        log = tmp / f"rank{rank}.log"
        full_env: dict[str, str] = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "PLAIT_TRACE_DIR": str(trace_dir), "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        if "PYTHONPATH" in (env or {}):
            with open(log, "w") as out:
                procs.append(subprocess.Popen([sys.executable, str(SCENARIOS), scenario], env=full_env, cwd=ROOT,
                                              stdout=out, stderr=subprocess.STDOUT))
        else:
            procs.append(_fork([str(SCENARIOS), scenario], full_env, log))
        logs.append(log)
    return Job(procs, logs, time.monotonic(), trace_dir)


def run(scenario: str, world: int, tmp: Path, env: dict[str, str] | None = None, limit_s: float = 60.0) -> JobResult:
    return start(scenario, world, tmp, env).wait(limit_s)
