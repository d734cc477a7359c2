"""Start a scenario of scenarios.py as N real rank processes and collect what they did.

Real processes, not the test pool: the watchdog ends its process, and "no process left
hanging" is part of what the tests check. Every rank that outlives `limit_s` is killed and
reported as hanging.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCENARIOS = Path(__file__).with_name("scenarios.py")
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Job:
    procs: list[subprocess.Popen]
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
        full_env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1", "PLAIT_TRACE_DIR": str(trace_dir), "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        with open(log, "w") as out:
            procs.append(subprocess.Popen([sys.executable, str(SCENARIOS), scenario], env=full_env, cwd=ROOT,
                                          stdout=out, stderr=subprocess.STDOUT))
        logs.append(log)
    return Job(procs, logs, time.monotonic(), trace_dir)


def run(scenario: str, world: int, tmp: Path, env: dict[str, str] | None = None, limit_s: float = 60.0) -> JobResult:
    return start(scenario, world, tmp, env).wait(limit_s)
