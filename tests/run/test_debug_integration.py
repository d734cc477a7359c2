"""`plait run` with PLAIT_DISTRIBUTED_DEBUG set: a worker script that uses only
torch.distributed (never imports plait) is still checked, through the bootstrap the
launcher puts on its PYTHONPATH."""

import os
import subprocess
import sys
from pathlib import Path

from tests.debug.scenarios import fault_line

ROOT = Path(__file__).resolve().parents[2]


def test_debug_env_reaches_workers_that_never_import_plait(tmp_path):
    env = dict(os.environ, PLAIT_DISTRIBUTED_DEBUG="DETAIL", PLAIT_COLLECTIVE_TIMEOUT="20",
               PLAIT_TRACE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "plait.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "debug" / "scenarios.py"), "raw_torch"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "CollectiveMismatchError" in out and "size mismatch" in out, out
    assert f"scenarios.py:{fault_line('raw_torch')}" in out, out
