"""A restart that works with a real process group: Gloo all-reduce, crash, restart, all-reduce again.

torchrun (torch 2.13) fails this: the restarted ranks read the previous attempt's rendezvous keys
(pytorch#135712). plait gives every attempt a fresh worker store, so it must pass every time.
"""

from __future__ import annotations

from tests.run.conftest import worker


def test_gloo_group_all_reduces_again_after_a_crash_and_restart(job):
    r = job.run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", worker("gloo_allreduce.py"),
                env={"CRASH_RANK": "1"})
    assert r.rc == 0, r.err
    assert job.outputs("allreduce_") == ["allreduce_a0_r0", "allreduce_a0_r1", "allreduce_a1_r0", "allreduce_a1_r1"]
    assert all(job.read(name)["sum"] == 3.0 for name in job.outputs("allreduce_"))
    assert "rank 1 (node " in r.err and "exited with code 13; restarting every worker (restart 1 of 1)" in r.err
