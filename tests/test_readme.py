"""The README's examples run: each Python block that starts a process group is run as a
script under `plait run` on a local rank count that fits it (the CommDebugMode block
continues the plait.comm block, as the README reads)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def _find(blocks: list[str], needle: str) -> str:
    found = [b for b in blocks if needle in b]
    assert len(found) == 1, f"expected one README block containing {needle!r}, found {len(found)}"
    return found[0]


def readme_jobs() -> dict[str, tuple[str, int]]:
    """name -> (script, ranks) for each README example that starts a process group."""
    blocks = _blocks()
    return {
        "comm": (_find(blocks, "comm.init_process_group()                          # RANK")
                 + _find(blocks, "with CommDebugMode() as mode:"), 2),
        "mesh": ("from plait import comm\ncomm.init_process_group()\n" + _find(blocks, "init_device_mesh(\"cpu\", (2, 2, 2)"), 8),
        "ddp": (_find(blocks, "from plait.ddp import DistributedDataParallel as DDP   #"), 2),
        "zero": (_find(blocks, "ZeroRedundancyOptimizer(model.parameters()"), 2),
        "pipeline": (_find(blocks, "Schedule1F1B"), 2),
        "fsdp": (_find(blocks, "from plait.fsdp import fully_shard"), 2),
        "fsdp1": (_find(blocks, "FullyShardedDataParallel as FSDP"), 2),
        "tp": (_find(blocks, 'parallelize_module(model, mesh["tp"], tp_plan())'), 4),
        "fsdp_tp": (_find(blocks, 'fully_shard(block, mesh=mesh["dp"])'), 4),
        "checkpoint": (_find(blocks, 'dcp.save({"model": model, "step": 100}'), 2),
    }


def test_readme_examples_run_under_plait_run(tmp_path):
    failures = _run(readme_jobs(), tmp_path)
    assert not failures, "\n".join(f"--- README example {n!r} failed:\n{o[-3000:]}" for n, o in failures.items())


MAX_RANKS = 8  # ranks running at once: the 8-rank example alone, or several small ones, never all


def _run(jobs: dict, tmp_path: Path) -> dict[str, str]:
    """Run the jobs under `plait run`, at most MAX_RANKS ranks at a time (28 ranks at once on 2
    cores only thrash); return the output of those that failed. Each job's bound starts with it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    waiting = sorted(jobs.items(), key=lambda item: -item[1][1])  # the 8-rank job first, then fill in
    running: dict[str, tuple[subprocess.Popen, int, float]] = {}
    failures = {}
    while waiting or running:
        for name, (script, ranks) in list(waiting):
            if sum(r for _, r, _ in running.values()) + ranks > MAX_RANKS and running:
                continue
            path = tmp_path / f"{name}.py"
            path.write_text(script)
            proc = subprocess.Popen(
                [sys.executable, "-m", "plait.run", "--standalone", "--nproc-per-node", str(ranks), str(path)],
                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            running[name] = (proc, ranks, time.monotonic())
            waiting.remove((name, (script, ranks)))
        done = next((n for n, (p, _, t0) in running.items()
                     if p.poll() is not None or time.monotonic() - t0 > 240), None)
        if done is None:
            time.sleep(0.2)
            continue
        proc, _, _ = running.pop(done)
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
        if proc.returncode != 0 or "terminate called" in out:  # Gloo's exit-time abort: tests/comm/test_exit.py
            failures[done] = out
    return failures
