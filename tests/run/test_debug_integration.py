"""`plait run` with PLAIT_DISTRIBUTED_DEBUG set: a worker script that uses only
torch.distributed (never imports plait) is still checked, through the bootstrap the
launcher puts on its PYTHONPATH; and a hang is reported in full by every rank that reports,
with the store served by the launcher."""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.debug.scenarios import fault_line
from tests.run.conftest import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def test_debug_env_reaches_workers_that_never_import_plait(tmp_path):
    env = dict(os.environ, PLAIT_DISTRIBUTED_DEBUG="DETAIL", PLAIT_COLLECTIVE_TIMEOUT="20",
               PLAIT_TRACE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "plait.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "debug" / "scenarios.py"), "raw_torch"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "CollectiveMismatchError" in out and "size mismatch" in out, out
    assert f"scenarios.py:{fault_line('raw_torch')}" in out, out


def test_a_hang_is_reported_in_full_by_every_rank_that_reports(tmp_path):
    """Both stages time out at about the same moment; the launcher stops the job when the first
    rank exits. Every report is whole: none is cut short by a peer's exit or by the stop."""
    env = dict(os.environ, PLAIT_DESYNC_DEBUG="1", PLAIT_COLLECTIVE_TIMEOUT="4",
               PLAIT_TRACE_DIR=str(tmp_path / "trace"), OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "plait.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "tests" / "debug" / "scenarios.py"), "send_without_recv"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "exitcode  : 124" in out, out
    per_rank = {r: "\n".join(re.findall(rf"^\[rank {r}\] (.*)$", out, re.M)) for r in (0, 1)}
    reports = [text for text in per_rank.values() if "desync report" in text]
    assert reports, out
    for report in reports:
        assert "culprit(s): [1]" in report, report  # stage 1 never posted the second recv
        assert "undecided" not in report and "side channel failed" not in report, report
        assert f"scenarios.py:{fault_line('send_without_recv')} in send_without_recv" in report, report
        assert f"scenarios.py:{fault_line('send_without_recv_barrier')} in send_without_recv" in report, report
