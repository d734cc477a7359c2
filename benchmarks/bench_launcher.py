"""Launcher: `plait run` against `torchrun`, 4 workers on one node, same worker script, same run.

Rows (medians of several runs; ratio plait / torchrun, lower is better):
- start → every worker has passed `init_process_group("gloo")` and a barrier;
- a worker's crash → the restarted workers have passed the barrier again. torchrun 2.13 cannot
  restart a Gloo job whose workers use plain `init_process_group()` (pytorch#135712), so for
  this row both launchers run workers that prefix the store by attempt themselves; a separate
  row counts how often each launcher restarts the plain script successfully;
- launcher overhead: wall time of a job whose 4 workers do nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import median, print_table, ratio

REPO = Path(__file__).resolve().parents[1]
NPROC = 4
TIMEOUT = 90.0

WORKER = r'''
import os, sys, time
from datetime import timedelta
import torch.distributed as dist

out, crash, by_hand = sys.argv[1], sys.argv[2] == "crash", sys.argv[3] == "prefix"
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if by_hand:  # what a torchrun user must do for a restart to find fresh keys
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    store = dist.PrefixStore(f"attempt_{attempt}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
else:
    dist.init_process_group("gloo")
dist.barrier()
now = time.time()
with open(os.path.join(out, f"barrier_{attempt}_{rank}"), "w") as f:
    f.write(repr(now))
if crash and attempt == 0:
    dist.barrier()  # every rank has written its time
    if rank == 1:
        with open(os.path.join(out, "crash"), "w") as f:
            f.write(repr(time.time()))
        os._exit(1)
    time.sleep(60)  # stopped by the launcher
dist.destroy_process_group()
'''

LAUNCHERS = {
    "plait run": [sys.executable, "-m", "plait.run"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def _launch(launcher: str, script: Path, out: Path, *args: str, restarts: int = 0) -> tuple[int, float]:
    """Run one job; returns (exit code, wall seconds). A job past TIMEOUT is killed (code -9)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [*LAUNCHERS[launcher], "--standalone", "--nproc-per-node", str(NPROC), "--max-restarts", str(restarts),
           str(script), str(out), *args]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        code = proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = -9
    return code, time.time() - t0


def _times(out: Path, attempt: int) -> list[float]:
    return [float((out / f"barrier_{attempt}_{r}").read_text()) for r in range(NPROC)
            if (out / f"barrier_{attempt}_{r}").exists()]


def _startup(launcher: str, script: Path, tmp: Path, i: int) -> float | None:
    out = tmp / f"start-{launcher.replace(' ', '')}-{i}"
    out.mkdir()
    t0 = time.time()
    code, _ = _launch(launcher, script, out, "ok", "plain")
    times = _times(out, 0)
    return max(times) - t0 if code == 0 and len(times) == NPROC else None


def _restart(launcher: str, script: Path, tmp: Path, i: int, how: str) -> float | None:
    out = tmp / f"restart-{how}-{launcher.replace(' ', '')}-{i}"
    out.mkdir()
    code, _ = _launch(launcher, script, out, "crash", how, restarts=1)
    times = _times(out, 1)
    if code != 0 or len(times) != NPROC:
        return None
    return max(times) - float((out / "crash").read_text())


def _fmt(xs: list[float | None]) -> str:
    ok = [x for x in xs if x is not None]
    return f"{median(ok):.2f} s" if ok else "failed"


def run(quick: bool) -> None:
    repeats = 2 if quick else 5
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-launcher-") as tmp_name:
        tmp = Path(tmp_name)
        script = tmp / "worker.py"
        script.write_text(WORKER)
        noop = tmp / "noop.py"
        noop.write_text("")

        results: dict[str, dict[str, list]] = {name: {"start": [], "restart": [], "plain": [], "noop": []}
                                               for name in LAUNCHERS}
        for i in range(repeats):  # interleaved, so both launchers see the same machine load
            for name in LAUNCHERS:
                results[name]["start"].append(_startup(name, script, tmp, i))
                results[name]["restart"].append(_restart(name, script, tmp, i, "prefix"))
                results[name]["plain"].append(_restart(name, script, tmp, i, "plain"))
                code, wall = _launch(name, noop, tmp)
                results[name]["noop"].append(wall if code == 0 else None)

        def row(label: str, key: str) -> list[str]:
            p, t = results["plait run"][key], results["torchrun"][key]
            pm = [x for x in p if x is not None]
            tm = [x for x in t if x is not None]
            r = ratio(median(pm), median(tm)) if pm and tm else "n/a"
            return [label, _fmt(p), _fmt(t), r]

        rows.append(row(f"start -> all {NPROC} workers past init_process_group + barrier", "start"))
        rows.append(row("worker crash -> restarted workers past the barrier (store prefixed by hand)", "restart"))
        plain = {name: sum(x is not None for x in results[name]["plain"]) for name in LAUNCHERS}
        rows.append(["restart with plain init_process_group(): successful restarts",
                     f"{plain['plait run']}/{repeats}", f"{plain['torchrun']}/{repeats}", ""])
        rows.append(row(f"no-op job, {NPROC} workers: launcher wall time", "noop"))
    print_table(
        "Launcher: plait run vs torchrun (one node, 4 Gloo/CPU workers)",
        ["measure", "plait run", "torchrun", "plait / torchrun"],
        rows,
        notes=(f"Medians of {repeats} runs each, launchers interleaved; {os.cpu_count()} CPU cores, "
               f"OMP_NUM_THREADS=1. torchrun's plain-script restarts fail in Gloo's connectFullMesh: the "
               f"restarted ranks read the previous attempt's addresses from the agent store (pytorch#135712)."),
    )


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
