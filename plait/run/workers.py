"""Start, watch and stop this node's workers for one round.

    RoundInfo ──worker_env()──▶ env per local rank ──Popen(own group)──▶ one process group per worker
    poll():  exit codes ──▶ Failure (error file read) for each worker that failed on its own
    stop():  signal every worker's whole process group ── grace ──▶ SIGKILL, until no process is left

Each worker leads its own process group, so stop() also reaches the children a worker spawned
(pytorch#110065); a group counts as stopped only when /proc shows no live process in it. The
group is a new session (torchrun's choice) only where this agent has a controlling terminal:
there a session keeps a worker that reads the terminal (a breakpoint) from being stopped by job
control. Without a terminal (batch jobs, CI) a session only changes the scheduler's autogroup,
and a fresh autogroup was measured to starve: under pytest with two busy loops in its session
(Linux 6.18), a child in a new session took 26-72 s of wall time to get 1 CPU s, one in a new
process group 1.5-1.8 s. Python workers also ask the kernel to SIGKILL them if this agent dies
(bootstrap.py), so a killed launcher leaves no workers behind. A grandchild that starts its own
session escapes both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from string import Template

from plait.debug.activate import bootstrap_dir
from plait.debug.config import env_asks_for_debugging
from plait.run.config import LaunchConfig, LaunchError, Std, StdSpec
from plait.run.errors import Failure
from plait.run.logs import LogPump, RunDir, line_prefix
from plait.run.rounds import RoundInfo

_STOP_POLL = 0.02
_KILL_WAIT = 5.0  # after SIGKILL the kernel needs no more than this to tear a group down


def worker_env(cfg: LaunchConfig, info: RoundInfo, local_rank: int, error_file: str) -> dict[str, str]:
    """The environment torchrun gives a worker (plus PLAIT_* twins), for this round and local rank."""
    rank = info.rank_offset + local_rank
    restarts = str(info.round)  # every regroup, failure or membership, starts a new round
    env = dict(os.environ)
    env.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(0 if cfg.virtual_local_rank else local_rank),
        "GROUP_RANK": str(info.group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": cfg.role,
        "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
        "WORLD_SIZE": str(info.world_size),
        "GROUP_WORLD_SIZE": str(len(info.nodes)),
        "ROLE_WORLD_SIZE": str(info.world_size),
        "MASTER_ADDR": info.master_addr,
        "MASTER_PORT": str(info.master_port),
        # the worker store is a fresh TCPStore served by an agent: workers connect, none hosts
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": restarts,
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
        "TORCHELASTIC_RUN_ID": cfg.rdzv.run_id,
        "TORCHELASTIC_ERROR_FILE": error_file,
        "PLAIT_RESTART_COUNT": restarts,
        "PLAIT_MAX_RESTARTS": str(cfg.max_restarts),
        "PLAIT_RUN_ID": cfg.rdzv.run_id,
        "PLAIT_ERROR_FILE": error_file,
        "PLAIT_AGENT_PID": str(os.getpid()),
    })
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if env_asks_for_debugging(env):
        # a worker that never imports plait still gets its torch.distributed calls traced
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (bootstrap_dir(), env.get("PYTHONPATH"))))
    if cfg.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N workers must not each take every core
    if cfg.virtual_local_rank:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(cfg.nproc_per_node)]
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank % len(devices)]
    return env


def worker_command(cfg: LaunchConfig, local_rank: int) -> list[str]:
    """The command, with torchrun's `${local_rank}` macro in the script's arguments filled in."""
    return [Template(arg).safe_substitute(local_rank=local_rank) for arg in cfg.command]


@dataclass
class Worker:
    local_rank: int
    global_rank: int
    proc: subprocess.Popen
    error_file: str
    exitcode: int | None = None


def own_group() -> dict[str, object]:
    """Popen's arguments that make a worker lead its own process group (docstring: why a session
    only with a controlling terminal)."""
    try:
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY))
    except OSError:
        return {"process_group": 0}
    return {"start_new_session": True}


def live_groups(pgids: set[int]) -> set[int]:
    """Those of `pgids` that still have a process that is not a zombie."""
    if not os.path.isdir("/proc"):
        alive = set()
        for pgid in pgids:
            try:
                os.killpg(pgid, 0)
                alive.add(pgid)
            except (ProcessLookupError, PermissionError):
                pass
        return alive
    alive = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # state ppid pgrp ...; comm may hold spaces
        if int(fields[2]) in pgids and fields[0] not in (b"Z", b"X"):
            alive.add(int(fields[2]))
    return alive


def _signal_groups(pgids, sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class WorkerGroup:
    """The workers of one node for one round."""

    def __init__(self, cfg: LaunchConfig, info: RoundInfo, run_dir: RunDir, *, on_output_closed: Callable[[], None]):
        self._cfg = cfg
        self._info = info
        self._run_dir = run_dir
        self._pump = LogPump(on_eof=on_output_closed)
        self.workers: list[Worker] = []
        self._stopping = False  # exits from now on are ours, not failures
        self._stopped = False

    def start(self) -> None:
        for local_rank in range(self._cfg.nproc_per_node):
            self.workers.append(self._spawn(local_rank))
        self._pump.start()

    def _spawn(self, local_rank: int) -> Worker:
        cfg, info, logs = self._cfg, self._info, self._cfg.logs
        rank = info.rank_offset + local_rank
        rank_dir = self._run_dir.rank_dir(info.round, rank)
        error_file = os.path.join(rank_dir, "error.json")
        if os.path.exists(error_file):
            os.remove(error_file)  # a reused --log-dir: never report an older run's error
        shown = logs.local_ranks_filter is None or local_rank in logs.local_ranks_filter
        implicit_tee = logs.log_dir is not None and logs.redirects == StdSpec() and logs.tee == StdSpec()
        tee = Std.ALL if implicit_tee else logs.tee.for_rank(local_rank)
        redirect = logs.redirects.for_rank(local_rank)
        prefix = line_prefix(logs.prefix_template, rank=rank, local_rank=local_rank, role=cfg.role,
                             node=info.me.name, multi_node=cfg.rdzv.max_nodes > 1)

        # per stream: (what Popen gets, console to pump to or None, log file to pump to or None)
        targets: dict[str, tuple] = {}
        opened = []
        for bit, name, console in ((Std.OUT, "stdout", sys.stdout.buffer), (Std.ERR, "stderr", sys.stderr.buffer)):
            path = os.path.join(rank_dir, f"{name}.log")
            if tee & bit:
                opened.append(open(path, "wb"))
                targets[name] = (subprocess.PIPE, console if shown else None, opened[-1])
            elif redirect & bit:  # straight to the file: no pipe, no console
                opened.append(open(path, "wb"))
                targets[name] = (opened[-1], None, None)
            elif shown:
                targets[name] = (subprocess.PIPE, console, None)
            else:
                targets[name] = (subprocess.DEVNULL, None, None)
        self._run_dir.has_logs |= bool(opened)
        try:
            proc = subprocess.Popen(
                worker_command(cfg, local_rank), env=worker_env(cfg, info, local_rank, error_file),
                stdout=targets["stdout"][0], stderr=targets["stderr"][0], **own_group(),
            )
        except OSError as e:
            for f in opened:
                f.close()
            raise LaunchError(f"cannot start {cfg.command[0]!r}: {e.strerror}") from None
        for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            target, console, file = targets[name]
            if target is subprocess.PIPE:
                self._pump.add(os.dup(pipe.fileno()), prefix=prefix, console=console, file=file)
                pipe.close()
            elif target is not subprocess.DEVNULL:
                target.close()  # the worker holds its own copy of its --redirects file
        return Worker(local_rank, rank, proc, error_file)

    def poll(self) -> list[Failure]:
        """Failures since the last poll (workers that exited non-zero before we stopped them)."""
        failures = []
        for w in self.workers:
            if w.exitcode is not None:
                continue
            w.exitcode = w.proc.poll()
            if w.exitcode not in (None, 0) and not self._stopping:
                failures.append(Failure.from_exit(
                    global_rank=w.global_rank, local_rank=w.local_rank, group_rank=self._info.group_rank,
                    node=self._info.me.name, pid=w.proc.pid, exitcode=w.exitcode, error_file=w.error_file,
                ))
        return failures

    @property
    def all_succeeded(self) -> bool:
        return all(w.exitcode == 0 for w in self.workers)

    def stop(self, sig: int = signal.SIGTERM, *, timeout: float, hurry: Callable[[], bool] = lambda: False) -> None:
        """Signal every worker's process group; SIGKILL whatever is left after `timeout` seconds."""
        if self._stopped:
            return
        self._stopping = self._stopped = True
        pgids = {w.proc.pid for w in self.workers}
        _signal_groups(pgids, sig)
        deadline = time.monotonic() + timeout
        alive = live_groups(pgids)
        while alive and time.monotonic() < deadline and not hurry():
            self.poll()  # reap direct children so they stop counting
            time.sleep(_STOP_POLL)
            alive = live_groups(alive)
        if alive:
            _signal_groups(alive, signal.SIGKILL)
            deadline = time.monotonic() + _KILL_WAIT
            while alive and time.monotonic() < deadline:
                self.poll()
                time.sleep(_STOP_POLL)
                alive = live_groups(alive)
        for w in self.workers:
            try:
                w.proc.wait(timeout=_KILL_WAIT)
            except subprocess.TimeoutExpired:
                pass
        self.poll()
        self._pump.stop(timeout=1.0)

