"""Failures and restarts on one node: counted for the job, reported with the first failure."""

from __future__ import annotations

import json
import os
import signal

from tests.run.conftest import pid_alive, worker


def test_worker_failing_once_is_restarted_and_the_job_succeeds(job):
    r = job.run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", worker("fail_once.py"))
    assert r.rc == 0, r.err
    # both ranks ran twice; the restart count in their environment went 0 -> 1
    assert job.outputs("ran_") == ["ran_a0_r0", "ran_a0_r1", "ran_a1_r0", "ran_a1_r1"]
    assert [job.read(f"ran_a{a}_r0") for a in (0, 1)] == ["0", "1"]
    assert "RuntimeError: planned failure on rank 1" in r.err  # its traceback, prefixed
    assert "[plait run] rank 1 (node " in r.err and "restarting every worker (restart 1 of 1)" in r.err


def test_worker_that_always_fails_runs_max_restarts_plus_one_times(job):
    r = job.run("--standalone", "--nproc-per-node", "2", "--max-restarts", "2", worker("always_fail.py"))
    assert r.rc == 1
    assert job.outputs("ran_") == [f"ran_a{a}_r{k}" for a in range(3) for k in range(2)]
    summary = r.err[r.err.index("=" * 72):]
    assert "always_fail.py FAILED after 3 attempt(s): no restarts left (--max-restarts 2)" in summary
    assert "rank      : 1 (local rank 1)" in summary and "exitcode  : 1" in summary
    assert "message   : ValueError: rank 1 always fails (value=42)" in summary
    # the traceback starts in the user's script, not in the launcher's bootstrap
    assert 'always_fail.py", line 17, in <module>' in summary and "in check_input" in summary
    assert "bootstrap.py" not in summary and "runpy" not in summary
    error_file = summary.split("error_file: ")[1].split()[0]
    assert f"attempt_2{os.sep}rank_1" in error_file
    data = json.load(open(error_file))  # torch's TORCHELASTIC_ERROR_FILE format
    assert data["message"]["message"] == "ValueError: rank 1 always fails (value=42)"
    assert "check_input" in data["message"]["extraInfo"]["py_callstack"]
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0


def test_sigkill_of_a_worker_mid_run_is_a_failure_named_by_its_signal(job):
    launch = job.start("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", worker("sleeper.py"),
                       env={"SLEEP_ATTEMPTS": "1"})
    job.wait_for_outputs("ready_a0_", 2)
    victim = job.read("ready_a0_r1")["worker"]
    other = job.read("ready_a0_r0")["worker"]
    os.kill(victim, signal.SIGKILL)
    r = launch.wait()
    assert r.rc == 0, r.err  # restarted once; the second attempt exits at once
    assert "rank 1 (node " in r.err and "was killed by SIGKILL; restarting every worker" in r.err
    lines = r.out.splitlines()
    assert "[rank 0] rank 0 attempt 1 exits at once" in lines and "[rank 1] rank 1 attempt 1 exits at once" in lines
    assert not pid_alive(other)  # the survivor of attempt 0 was stopped before the restart


def test_sigkill_without_restarts_left_fails_the_job(job):
    launch = job.start("--standalone", "--nproc-per-node", "2", worker("sleeper.py"))
    job.wait_for_outputs("ready_a0_", 2)
    os.kill(job.read("ready_a0_r0")["worker"], signal.SIGKILL)
    r = launch.wait()
    assert r.rc == 1
    assert "exitcode  : -9 (SIGKILL)" in r.err and "rank      : 0 (local rank 0)" in r.err
