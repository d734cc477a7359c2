"""Planted hangs in real rank processes: each is reported within the timeout, naming the
right ranks and the right line of scenarios.py, every process ends by itself with a
non-zero status, and the analyzer names the culprit and the kind from the dumps.

The jobs start together (module fixture) and mostly sleep through their timeouts, so the
module costs about one job's time, not the sum.
"""

import json
import signal
import time

import pytest

from plait import comm  # noqa: F401 - the door first: the watchdog below is imported through it
from plait.debug import WATCHDOG_EXIT_CODE, bootstrap_dir
from plait.debug.analyze import analyze
from plait.debug.cli import main as cli_main
from plait.debug.watchdog import Watchdog
from tests.debug import jobs
from tests.debug.scenarios import fault_line

T = 4.0  # PLAIT_COLLECTIVE_TIMEOUT of the hang jobs, seconds
LIMIT_S = 180.0  # a job still running after this is "left hanging" (a loaded machine starts ranks slowly)
# The watchdog's own bounds at that timeout: a report comes within the timeout, a poll, and
# the round's bounded waits (for the states, then for the first reporter's verdict)
_wd = Watchdog(timeout_s=T, dump=lambda *a: None, hints=lambda *a: [], trace_dir="")
REPORT_BY_S = T + _wd.poll_s + _wd.report_wait_s + _wd.follow_wait_s

JOBS = {
    # name: (scenario, world size, environment)
    "extra": ("extra_all_reduce", 2, {"PLAIT_DISTRIBUTED_DEBUG": "DETAIL"}),
    "extra_host1": ("extra_all_reduce", 2, {"PLAIT_DISTRIBUTED_DEBUG": "DETAIL", "STORE_HOST": "1"}),
    "send": ("send_without_recv", 2, {"PLAIT_DESYNC_DEBUG": "1"}),
    "send_host1": ("send_without_recv", 2, {"PLAIT_DESYNC_DEBUG": "1", "STORE_HOST": "1"}),
    "sleep": ("sleeper", 2, {"PLAIT_DESYNC_DEBUG": "1", "SLEEP_S": str(T + 6)}),
    "raw": ("raw_torch", 2, {"PLAIT_DISTRIBUTED_DEBUG": "DETAIL", "PYTHONPATH": bootstrap_dir()}),
    "info": ("correct", 2, {"PLAIT_DISTRIBUTED_DEBUG": "INFO"}),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    started = {}
    for name, (scenario, world, env) in JOBS.items():
        env = {"PLAIT_COLLECTIVE_TIMEOUT": str(T), **env}
        started[name] = jobs.start(scenario, world, tmp_path_factory.mktemp(name), env)
    try:
        yield {name: job.wait(LIMIT_S) for name, job in started.items()}
    finally:
        for job in started.values():
            job.kill()


def _dumps(result) -> dict[int, dict]:
    return {int(p.stem.removeprefix("rank")): json.loads(p.read_text()) for p in result.trace_dir.glob("rank*.json")}


def _reported_within_timeout(dump: dict) -> None:
    stuck = [e for e in dump["entries"] if e["state"] != "completed"]
    waited = (dump["dump_time_ns"] - stuck[-1]["time_scheduled_ns"]) / 1e9
    assert T - 0.2 <= waited <= REPORT_BY_S, f"reported {waited:.1f} s after the op was entered (timeout {T} s)"


@pytest.mark.parametrize("job", ["extra", "extra_host1"])
def test_rank_0_calls_one_all_reduce_more(results, job):
    """Rank 1 finishes without the extra op; when it serves the store ("extra_host1") it stays
    until rank 0 has reported, so the report still has rank 1's last state."""
    r = results[job]
    assert not r.hanging and r.returncodes == [WATCHDOG_EXIT_CODE, 0], r.describe()
    line = fault_line("extra_all_reduce")
    report = r.outputs[0]
    assert "desync report from rank 0" in report and f"scenarios.py:{line} in extra_all_reduce" in report, report
    assert "never entered it: [1]" in report and "rank 1: exited" in report, report
    assert "culprit(s): [0] — issued an op the others never issued: they finished without it" in report, report
    assert "side channel failed" not in report, report
    dumps = _dumps(r)
    assert set(dumps) == {0}, "rank 1 exited normally: no dump, its last state is in rank 0's"
    _reported_within_timeout(dumps[0])
    problem = analyze(str(r.trace_dir)).first
    assert problem.kind == "missing rank" and problem.culprits == [0] and problem.seq == 3, problem
    assert f"scenarios.py:{line}" in problem.sides[0]["site"]


@pytest.mark.parametrize("job", ["send", "send_host1"])
def test_send_with_no_matching_recv_between_two_stages(results, job):
    r = results[job]
    assert not r.hanging and all(c == WATCHDOG_EXIT_CODE for c in r.returncodes), r.describe()
    send_line, barrier_line = fault_line("send_without_recv"), fault_line("send_without_recv_barrier")
    # Both ranks time out at about the same time, in either order, and whichever hosts the
    # store ("send": rank 0, "send_host1": rank 1): every rank that reports gives the full
    # report with the one verdict, none is cut short by a peer's exit.
    reports = [o for o in r.outputs if "desync report" in o]
    assert reports, r.describe()
    for report in reports:
        assert "undecided" not in report and "side channel failed" not in report, report
        assert "no answer" not in report and "did not finish reading" not in report, report
        assert f"scenarios.py:{send_line} in send_without_recv" in report, report
        assert f"scenarios.py:{barrier_line} in send_without_recv" in report, report
        assert "culprit(s): [1]" in report, report  # stage 1 never posted the second recv
    dumps = _dumps(r)
    assert set(dumps) == {0, 1}
    for dump in dumps.values():  # the reporter(s); a rank that answered may have dumped earlier
        if dump["reason"].startswith("watchdog"):
            _reported_within_timeout(dump)
            assert dump["verdict"]["culprits"] == [1], dump["report"]
    result = analyze(str(r.trace_dir))
    problem = result.first
    assert problem.kind == "missing rank" and problem.op == "send" and problem.seq == 2, result
    assert problem.p2p == {"src": 0, "dst": 1} and problem.culprits == [1], problem
    assert f"scenarios.py:{send_line}" in problem.sides[0]["site"]


def test_rank_sleeping_past_the_timeout(results):
    r = results["sleep"]
    assert not r.hanging and r.returncodes == [WATCHDOG_EXIT_CODE, WATCHDOG_EXIT_CODE], r.describe()
    assert max(r.seconds.values()) < min(r.seconds.values()) + 3, "the sleeping rank is stopped too"
    sleep_line, op_line = fault_line("sleeper"), fault_line("sleeper_all_reduce")
    report = r.outputs[0]
    assert "never entered it: [1]" in report and "culprit(s): [1]" in report, report
    assert f"scenarios.py:{op_line} in sleeper" in report, report
    assert f'line {sleep_line}, in sleeper' in report, "rank 1's stack shows where it is"
    dumps = _dumps(r)
    _reported_within_timeout(dumps[0])
    assert dumps[1]["reason"].startswith("desync report requested by rank 0")
    problem = analyze(str(r.trace_dir)).first
    assert problem.kind == "missing rank" and problem.culprits == [1], problem
    assert f"now at tests/debug/scenarios.py:{sleep_line}" in problem.sides[1]["state"], problem


def test_a_script_using_only_torch_distributed_is_checked_under_the_bootstrap(results):
    r = results["raw"]
    assert not r.hanging and r.returncodes == [1, 1], r.describe()
    line = fault_line("raw_torch")
    for out in r.outputs:
        assert "CollectiveMismatchError" in out and "size mismatch" in out, out
        assert f"scenarios.py:{line} in raw_torch" in out, out
    dumps = _dumps(r)
    assert set(dumps) == {0, 1} and dumps[0]["reason"].startswith("unhandled CollectiveMismatchError")
    problem = analyze(str(r.trace_dir)).first
    assert problem.kind == "size mismatch" and problem.culprits == [], problem  # 1:1 — both sides listed
    assert {s["call"] for s in problem.sides} == {"all_reduce(sum) (4,) float32", "all_reduce(sum) (5,) float32"}


def test_info_prints_a_summary_at_exit_and_nothing_else(results):
    r = results["info"]
    assert not r.hanging and r.returncodes == [0, 0], r.describe()
    for rank, out in enumerate(r.outputs):
        assert f"DONE {rank}" in out
        assert f"[plait.debug] rank {rank}: 5 ops" in out, out
        assert "all_reduce      x3" in out and "barrier" in out, out
        assert "desync" not in out and " | " not in out, "INFO logs no op by op"
    assert not r.trace_dir.exists(), "a correct run leaves no dumps"


def test_sigusr1_dumps_a_running_job_for_the_analyzer(tmp_path, capsys):
    job = jobs.start("signal_dump", 2, tmp_path, {"PLAIT_COLLECTIVE_TIMEOUT": "120"})
    try:
        deadline = time.monotonic() + LIMIT_S
        while not all("READY" in log.read_text() for log in job.logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in job.procs), \
                [log.read_text() for log in job.logs]
            time.sleep(0.05)
        # rank 0 printed READY with its all-reduce in flight, rank 1 before its sleep
        job.signal(signal.SIGUSR1)
        paths = [job.trace_dir / f"rank{r}.json" for r in range(2)]
        while not all(p.exists() for p in paths):
            assert time.monotonic() < deadline, [log.read_text() for log in job.logs]
            time.sleep(0.05)
        assert all(p.poll() is None for p in job.procs), "SIGUSR1 dumps; it does not stop the job"
    finally:
        job.kill()
    assert json.loads(paths[0].read_text())["reason"].startswith("signal")
    assert cli_main(["analyze", str(job.trace_dir)]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM: missing rank — all_reduce #2" in out, out
    assert f"scenarios.py:{fault_line('signal_dump')}" in out and "culprit: rank 1" in out, out
    assert f"now at tests/debug/scenarios.py:{fault_line('signal_dump_sleep')}" in out, out
    assert cli_main(["analyze", str(job.trace_dir), "--json"]) == 1
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["first"]["kind"] == "missing rank" and parsed["first"]["culprits"] == [1]
