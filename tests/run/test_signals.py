"""Stopping: signals to the launcher, whole process groups, and nothing left behind (checked by pid)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.run.conftest import pid_alive, worker

WORKER_SLEEP_S = 60  # sleeper.py's sleep: a launcher that waited for its worker would take this long
DEFAULT_GRACE_S = 30  # --shutdown-timeout's default
# A bound on a stop: well under both waits a broken launcher would make, and far above the
# second or so a stop takes, so that a loaded machine's slowness never reaches it.
STOP_BOUND_S = min(WORKER_SLEEP_S, DEFAULT_GRACE_S) - 10


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_stops_every_worker_and_their_children(job, sig):
    launch = job.start("--standalone", "--nproc-per-node", "2", worker("sleeper.py"), env={"SPAWN_CHILD": "1"})
    job.wait_for_outputs("ready_a0_", 2)
    pids = [p for r in (0, 1) for p in job.read(f"ready_a0_r{r}").values()]
    assert len(pids) == 4 and all(pid_alive(p) for p in pids)
    os.kill(launch.pid, sig)
    r = launch.wait()
    assert r.rc == 128 + sig, r.err  # what a shell reports for death by that signal
    assert f"received {sig.name}: stopped 2 worker(s)" in r.err
    assert not [p for p in pids if pid_alive(p)]  # workers and grandchildren, gone by the time it exits


def test_worker_ignoring_sigterm_is_killed_after_the_shutdown_timeout(job):
    launch = job.start("--standalone", "--nproc-per-node", "1", "--shutdown-timeout", "1", worker("sleeper.py"),
                       env={"IGNORE_TERM": "1"})
    job.wait_for_outputs("ready_a0_", 1)
    pid = job.read("ready_a0_r0")["worker"]
    t0 = time.monotonic()
    os.kill(launch.pid, signal.SIGTERM)
    r = launch.wait()
    assert r.rc == 143 and not pid_alive(pid)
    assert 0.9 < time.monotonic() - t0 < STOP_BOUND_S  # the 1 s grace, then SIGKILL


def test_second_signal_skips_the_grace_period(job):
    launch = job.start("--standalone", "--nproc-per-node", "1", "--shutdown-timeout", "120", worker("sleeper.py"),
                       env={"IGNORE_TERM": "1"})
    job.wait_for_outputs("ready_a0_", 1)
    t0 = time.monotonic()
    os.kill(launch.pid, signal.SIGTERM)
    # the worker saw the launcher's SIGTERM: the launcher took the first signal and is in its
    # grace period (sent sooner, two signals could merge into one before its handler ran)
    job.wait_for_outputs("termed_a0_", 1)
    os.kill(launch.pid, signal.SIGTERM)
    r = launch.wait()
    assert r.rc == 143 and time.monotonic() - t0 < STOP_BOUND_S  # not the 120 s grace, nor the worker's sleep


def test_child_of_a_worker_dies_when_another_rank_fails(job):
    r = job.run("--standalone", "--nproc-per-node", "2", worker("child_then_fail.py"))
    assert r.rc == 1
    child = job.read("child_r0")
    assert not pid_alive(child)


def test_child_left_running_by_a_successful_worker_does_not_outlive_the_launcher(job):
    r = job.run("--standalone", "--nproc-per-node", "1", worker("child_then_exit.py"))
    assert r.rc == 0, r.err
    assert not pid_alive(job.read("child_r0"))
