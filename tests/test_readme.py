"""The README's examples run: each Python block that starts a process group is run as a
script under `plait run` on a local rank count that fits it (the CommDebugMode block
continues the plait.comm block, as the README reads).

One launch per rank count (8, 4, 2: three launches for eleven examples, one at a time), in which
tests/readme_driver.py runs each example as its own script in a fork of the worker, with the
launcher's RANK/WORLD_SIZE and a fresh rendezvous store. Every example must exit 0 on every
rank. Ten launches of their own cost 113-152 CPU s (30 workers, each importing torch and
torch._dynamo and walking their objects at exit); these three cost 57-78 (load 4-20, shared).
The 2-rank launch also runs tests/comm/test_exit.py's module-level-groups script, which that
file asserts (`plait_run_failures`, run once for both files: a launch of its own was 3 more
interpreters that import torch).
"""

import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRIVER = Path(__file__).resolve().parent / "readme_driver.py"
PLAIT_RUN = (sys.executable, "-m", "plait.run")


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
        "dtensor": (_find(blocks, "torch.view_as_complex(x.reshape(2, 16, 4, 4, 2))"), 2),
    }


@functools.cache
def plait_run_failures() -> dict[str, str]:
    """name -> output, for each README example and tests/comm/test_exit.py's module-level-groups
    script that did not exit 0 on every rank under plait run (`_run`, one launch per rank count);
    run once, asserted by both files."""
    # imported here, not at the top: test_exit imports this file
    from tests.comm.test_exit import MODULE_LEVEL_GROUPS

    jobs = {**readme_jobs(), "module_level_groups": (MODULE_LEVEL_GROUPS, 2)}
    _where.append(tempfile.TemporaryDirectory(prefix="plait_readme_"))  # removed when pytest exits
    return _run(jobs, Path(_where[-1].name))


_where: list[tempfile.TemporaryDirectory] = []


def test_readme_examples_run_under_plait_run():
    failures = {name: out for name, out in plait_run_failures().items() if name in readme_jobs()}
    assert not failures, "\n".join(f"--- README example {n!r} failed:\n{o[-3000:]}" for n, o in failures.items())


def _run(jobs: dict, tmp_path: Path, launcher: tuple[str, ...] = PLAIT_RUN) -> dict[str, str]:
    """One launch per rank count (`launcher`: plait run, or torchrun as tests/comm/test_exit.py runs
    it), one after another, each running its examples in order through tests/readme_driver.py
    (one fork per example); return the output of each example that did not exit 0 on every rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    by_ranks: dict[int, list[str]] = {}
    for name, (script, ranks) in jobs.items():
        (tmp_path / f"{name}.py").write_text(script)
        by_ranks.setdefault(ranks, []).append(name)
    failures = {}
    for ranks, names in sorted(by_ranks.items(), reverse=True):
        try:
            out = subprocess.run(
                [*launcher, "--standalone", "--nproc-per-node", str(ranks), str(DRIVER),
                 *(f"{n}.py" for n in names)],
                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240).stdout
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() + "\n(timed out after 240 s)"
        for name in names:
            ok = re.findall(rf"README example {name}: rank (\d+) exit 0$", out, flags=re.M)
            # Gloo's exit-time abort (tests/comm/test_exit.py) would print this and still exit 0 here
            if sorted(map(int, ok)) != list(range(ranks)) or "terminate called" in out:
                failures[name] = out
    return failures
