"""`plait run` with PLAIT_DISTRIBUTED_DEBUG set: a worker script that uses only
torch.distributed (never imports plait) is still checked, through the bootstrap the
launcher puts on its PYTHONPATH; and a hang is reported in full by every rank that reports,
with the store served by the launcher.

The two jobs start together (module fixture): the module costs about one job's time.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.debug.scenarios import fault_line
from tests.run.conftest import HANG_S

ROOT = Path(__file__).resolve().parents[2]

JOBS = {  # name: (scenario, environment)
    "raw": ("raw_torch", {"PLAIT_DISTRIBUTED_DEBUG": "DETAIL", "PLAIT_COLLECTIVE_TIMEOUT": "20"}),
    "hang": ("send_without_recv", {"PLAIT_DESYNC_DEBUG": "1", "PLAIT_COLLECTIVE_TIMEOUT": "4"}),
}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """{job: (exit code, stdout + stderr)} of `plait run --nproc-per-node 2 scenarios.py NAME`."""
    procs = {}
    for name, (scenario, extra) in JOBS.items():
        tmp = tmp_path_factory.mktemp(name)
        env = dict(os.environ, PLAIT_TRACE_DIR=str(tmp / "trace"), OMP_NUM_THREADS="1", **extra)
        env.pop("PYTHONPATH", None)
        with open(tmp / "output", "w") as out:  # a file, not a pipe: nobody reads while both run
            procs[name] = (tmp / "output", subprocess.Popen(
                [sys.executable, "-m", "plait.run", "--standalone", "--nproc-per-node", "2",
                 str(ROOT / "tests" / "debug" / "scenarios.py"), scenario],
                env=env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            ))
    try:
        for _, p in procs.values():
            p.wait(timeout=HANG_S)
        yield {name: (p.returncode, path.read_text(errors="replace")) for name, (path, p) in procs.items()}
    finally:
        for _, p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_debug_env_reaches_workers_that_never_import_plait(outputs):
    rc, out = outputs["raw"]
    assert rc != 0, out
    assert "CollectiveMismatchError" in out and "size mismatch" in out, out
    assert f"scenarios.py:{fault_line('raw_torch')}" in out, out


def test_a_hang_is_reported_in_full_by_every_rank_that_reports(outputs):
    """Both stages time out at about the same moment; the launcher stops the job when the first
    rank exits. Every report is whole: none is cut short by a peer's exit or by the stop."""
    rc, out = outputs["hang"]
    assert rc == 1 and "exitcode  : 124" in out, out
    per_rank = {r: "\n".join(re.findall(rf"^\[rank {r}\] (.*)$", out, re.M)) for r in (0, 1)}
    reports = [text for text in per_rank.values() if "desync report" in text]
    assert reports, out
    for report in reports:
        assert "culprit(s): [1]" in report, report  # stage 1 never posted the second recv
        assert "undecided" not in report and "side channel failed" not in report, report
        assert f"scenarios.py:{fault_line('send_without_recv')} in send_without_recv" in report, report
        assert f"scenarios.py:{fault_line('send_without_recv_barrier')} in send_without_recv" in report, report
