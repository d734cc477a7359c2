"""Fixtures for launcher tests: start `plait run` as a real process, bounded, and leave nothing behind.

`launch(...)` starts `python -m plait.run ...` in its own process group with its output in files; every
launch is killed at the end of the test if still running, and every pid a worker script
registered (workers, their children) must be gone — the check is by pid, not by name.

Every wait here is for an event (a process exiting, a line on stderr, a file appearing) and
returns as soon as it happens; its bound, HANG_S, only tells a stuck launcher from a slow one
on a loaded machine, so it is generous: a passing test never waits for it. A launch that
outlives it fails the test with the Python stack of every process it started (stackdump/).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.run.workers._common import HANG_S  # the bound on every wait for an event

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
STACKDUMP = Path(__file__).resolve().parent / "stackdump"  # its sitecustomize: SIGUSR2 -> stacks
PYTHON = sys.executable
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS")


def worker(name: str) -> str:
    return str(WORKERS / name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it (by parent pid: workers lead their own process groups)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def stacks_of(pids: list[int], stacks: Path) -> str:
    """Every thread's Python stack of each process in `pids` (stackdump/sitecustomize.py)."""
    def size(pid: int) -> int:
        try:
            return (stacks / f"{pid}.txt").stat().st_size
        except OSError:
            return -1

    before = {pid: size(pid) for pid in pids}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGUSR2)
        except ProcessLookupError:
            pass
    # faulthandler writes from each process's signal handler, once that process is scheduled: on
    # a loaded machine that is not within a fixed second. Wait until every file that exists has
    # grown and then stayed the same size for 0.3 s (bounded; a process that has exited writes nothing).
    deadline, last = time.monotonic() + 15.0, {}
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = {pid: size(pid) for pid in pids}
        if all(now[p] < 0 or not pid_alive(p) or (now[p] > before[p] and now[p] == last.get(p)) for p in pids):
            break
        last = now
    parts = []
    for pid in pids:
        path = stacks / f"{pid}.txt"
        if path.exists():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            parts.append(f"--- stacks of pid {pid} ({cmd.strip()[:160]})\n{path.read_text(errors='replace')[-4000:]}")
    return "\n".join(parts) or "(no process left to ask for its stack)"


@dataclass
class Result:
    rc: int
    out: str
    err: str


class Launch:
    """One `plait run` process (an agent), its output in files under the test's tmp dir."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, name: str, wrap: list[str]):
        self.out_path, self.err_path = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
        self.stacks = Path(env["PLAIT_TEST_STACKS"])
        # its own process group (killpg reaches it), in pytest's session: a new session is a new
        # scheduler autogroup, which waited up to 72 s for the CPU beside busy loops (workers.py)
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [*wrap, PYTHON, "-m", "plait.run", *args], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                env=env, cwd=cwd, process_group=0,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> Result:
        return Result(self.proc.returncode, self.out_path.read_text(errors="replace"),
                      self.err_path.read_text(errors="replace"))

    def wait(self, timeout: float = HANG_S) -> Result:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            stacks = self.stacks_now()
            self.kill()
            r = self.output()
            pytest.fail(f"plait run did not exit within {timeout} s\n--- stdout\n{r.out}\n--- stderr\n{r.err}\n"
                        f"{stacks}")
        return self.output()

    def stacks_now(self) -> str:
        """The Python stacks of this launch and every process below it, if it still runs."""
        return stacks_of(descendants(self.proc.pid), self.stacks) if self.proc.poll() is None else ""

    def wait_for_stderr(self, text: str, timeout: float = HANG_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.err_path.read_text(errors="replace"):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        stacks = self.stacks_now()
        r = self.output()
        pytest.fail(f"{text!r} not on stderr within {timeout} s\n--- stdout\n{r.out}\n--- stderr\n{r.err}\n{stacks}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


class Job:
    """A test's view of its jobs: where workers write, and how to start `plait run`."""

    def __init__(self, tmp_path: Path):
        self.dir = tmp_path
        self.out = tmp_path / "out"
        self.pids = tmp_path / "pids"
        self.stacks = tmp_path / "stacks"
        self.out.mkdir()
        self.pids.mkdir()
        self.stacks.mkdir()
        self.launches: list[Launch] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "PLAIT_", "TORCHELASTIC_"))}
        for k in _LAUNCHER_VARS:
            env.pop(k, None)
        path = [str(STACKDUMP), str(REPO), env.get("PYTHONPATH", "")]
        env.update(PYTHONPATH=os.pathsep.join(path).rstrip(os.pathsep), OMP_NUM_THREADS="1", TMPDIR=str(self.dir),
                   PLAIT_TEST_OUT=str(self.out), PLAIT_TEST_PIDS=str(self.pids), PLAIT_TEST_STACKS=str(self.stacks))
        env.update(extra)
        return env

    def start(self, *args: str, env: dict[str, str] | None = None, wrap: list[str] = ()) -> Launch:
        launch = Launch(list(args), self.env(**(env or {})), self.dir, f"agent{len(self.launches)}", list(wrap))
        self.launches.append(launch)
        return launch

    def run(self, *args: str, timeout: float = HANG_S, env: dict[str, str] | None = None) -> Result:
        return self.start(*args, env=env).wait(timeout)

    def read(self, name: str):
        return json.loads((self.out / name).read_text())

    def outputs(self, prefix: str, suffix: str = "") -> list[str]:
        return sorted(p.name for p in self.out.iterdir()
                      if p.name.startswith(prefix) and p.name.endswith(suffix) and not p.name.endswith(".tmp"))

    def wait_for_outputs(self, prefix: str, count: int, timeout: float = HANG_S, suffix: str = "") -> list[str]:
        deadline = time.monotonic() + timeout
        ended = False
        while time.monotonic() < deadline and not ended:
            ended = bool(self.launches) and all(launch.proc.poll() is not None for launch in self.launches)
            names = self.outputs(prefix, suffix)  # read after the check: a last write still counts
            if len(names) >= count:
                return names
            time.sleep(0.05)
        why = "every launch exited" if ended else f"not within {timeout} s"
        logs = "\n".join(f"--- {launch.err_path.name} (exit code {launch.proc.poll()})\n{launch.output().err}\n"
                         f"{launch.stacks_now()}" for launch in self.launches)
        pytest.fail(f"expected {count} outputs {prefix}*, got {self.outputs(prefix)} ({why})\n{logs}")

    def registered_pids(self) -> list[int]:
        return [int(p.name) for p in self.pids.iterdir()]

    def assert_no_process_left(self, timeout: float = 30.0) -> None:
        pids = self.registered_pids()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.05)
        left = [p for p in pids if pid_alive(p)]
        for pid in left:  # fail the test, but don't leak into the next one
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert not left, f"processes outlived the launcher: {left}"


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    for launch in j.launches:
        launch.kill()
    j.assert_no_process_left()
