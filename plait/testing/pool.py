"""A persistent pool of rank processes per world size, so tests don't pay start-up.

    run(fn, world_size=4) -> pool for 4 (started once: fork from a forkserver that
    imported torch and warmed Dynamo, _forkserver.py; each rank joins a Gloo group)
    -> send fn to every rank -> collect

The invariant: a pool that finished a task cleanly on every rank is reused; after any
failure (an exception on a rank, a timeout, a dead worker) it is torn down, because its
ranks may disagree on which collectives ran. A timeout reports every live rank's Python
stack (SIGUSR1 -> faulthandler) before the pool is killed; nothing outlives a pool.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.connection import wait
from typing import Any

MAX_POOLED_PROCESSES = 24
ERROR_GRACE_S = 5.0  # after one rank fails, how long the others get to finish or fail
# the first start includes the forkserver's torch import and Dynamo warm-up (6.2 CPU s): 74 s of
# wall time were seen at load average 46 on 2 cores
START_TIMEOUT_S = 300.0


class DistributedTestError(AssertionError):
    """A distributed test failed on at least one rank; the message has every rank's story."""


class WorkerPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.dir = tempfile.mkdtemp(prefix=f"plait-pool{world_size}-")
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["plait.testing._forkserver"])  # torch loaded, Dynamo warmed
        from plait.testing import _worker

        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker.main,
                args=(rank, world_size, child, self._path("store"), self._path(f"log{rank}"),
                      self._path(f"stack{rank}")),
                name=f"plait-rank{rank}-of{world_size}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.last_used = time.monotonic()
        self._collect("start", START_TIMEOUT_S, expect_ready=True)

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def run(self, fn: Any, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not the pool's
        self.last_used = time.monotonic()
        payload = pickle.dumps((fn, args, kwargs))
        for conn in self.conns:
            conn.send((list(sys.path), payload))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout)

    def _collect(self, what: str, timeout: float, expect_ready: bool = False) -> list[Any]:
        __tracebackhide__ = True
        n = self.world_size
        results: list[Any] = [None] * n
        errors: dict[int, str] = {}
        outputs: dict[int, str] = {}
        pending = set(range(n))
        deadline = time.monotonic() + timeout
        timed_out = False
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            waitables = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
            for ready in wait(list(waitables), timeout=remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                pending.discard(rank)
                try:
                    if ready is self.procs[rank].sentinel and not self.conns[rank].poll():
                        raise EOFError
                    message = self.conns[rank].recv()
                except (EOFError, OSError):
                    self.procs[rank].join(timeout=2.0)
                    errors[rank] = f"worker died with exit code {self.procs[rank].exitcode}\n" + self._tail(f"log{rank}")
                    continue
                if expect_ready:
                    continue
                status, body, output = message
                if output:
                    outputs[rank] = output
                if status == "ok":
                    results[rank] = pickle.loads(body)
                else:
                    errors[rank] = body
            if errors and pending:
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        stacks = self._dump_stacks(sorted(pending)) if pending else {}
        for rank in sorted(outputs):
            sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in outputs[rank].splitlines()))
        if errors or pending:
            self.close()
            raise DistributedTestError(self._report(what, timeout, errors, pending, stacks, timed_out))
        return results

    def _report(self, what, timeout, errors, pending, stacks, timed_out) -> str:
        n = self.world_size
        lines = []
        if timed_out and not errors:
            lines.append(f"{what} did not finish within {timeout:.0f} s on ranks {sorted(pending)} of {n}")
        else:
            lines.append(f"{what} failed on ranks {sorted(errors)} of {n}"
                         + (f"; ranks {sorted(pending)} were still running" if pending else ""))
        for rank in sorted(errors):
            lines.append(f"\n--- rank {rank}: error ---\n{errors[rank].rstrip()}")
        for rank in sorted(stacks):
            lines.append(f"\n--- rank {rank}: Python stack when stopped ---\n{stacks[rank].rstrip()}")
        return "\n".join(lines)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        offsets = {r: os.path.getsize(self._path(f"stack{r}")) for r in ranks if os.path.exists(self._path(f"stack{r}"))}
        for rank in ranks:
            if self.procs[rank].is_alive():
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        time.sleep(1.0)  # faulthandler writes from its signal handler; give it a moment
        stacks = {}
        for rank in ranks:
            try:
                with open(self._path(f"stack{rank}")) as f:
                    f.seek(offsets.get(rank, 0))
                    stacks[rank] = f.read() or "(no stack written: the process did not respond)"
            except OSError as e:
                stacks[rank] = f"(no stack: {e})"
        return stacks

    def _tail(self, name: str, limit: int = 4000) -> str:
        try:
            with open(self._path(name), errors="replace") as f:
                text = f.read()
        except OSError:
            return ""
        return text[-limit:]

    def close(self) -> None:
        """Stop every worker (politely, then by force) and remove the pool's files."""
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 3.0
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        if _pools.get(self.world_size) is self:
            del _pools[self.world_size]
        shutil.rmtree(self.dir, ignore_errors=True)


_pools: dict[int, WorkerPool] = {}


def get_pool(world_size: int) -> WorkerPool:
    pool = _pools.get(world_size)
    if pool is None:
        while _pools and sum(_pools) + world_size > MAX_POOLED_PROCESSES:
            min(_pools.values(), key=lambda p: p.last_used).close()
        pool = WorkerPool(world_size)
        _pools[world_size] = pool
    return pool


def shutdown() -> None:
    """Stop every pool (registered to run at exit)."""
    for pool in list(_pools.values()):
        pool.close()


atexit.register(shutdown)
