"""Worker output: rank prefixes on the console, files per rank per attempt, --tee/--redirects/filters."""

from __future__ import annotations

from tests.run.conftest import worker


def test_console_lines_carry_the_global_rank_and_keep_their_stream(job):
    r = job.run("--standalone", "--nproc-per-node", "2", worker("talker.py"))
    assert r.rc == 0, r.err
    assert sorted(r.out.splitlines()) == ["[rank 0] out 0 attempt 0", "[rank 1] out 1 attempt 0"]
    assert "[rank 0] err 0 attempt 0" in r.err.splitlines() and "[rank 1] err 1 attempt 0" in r.err.splitlines()


def test_partial_line_is_shown_then_continued_without_a_second_prefix(job):
    r = job.run("--standalone", "--nproc-per-node", "1", worker("talker.py"), env={"PARTIAL": "1"})
    assert r.rc == 0, r.err
    assert r.out.splitlines() == ["[rank 0] out 0 attempt 0", "[rank 0] prompt> answer"]


def test_log_dir_keeps_a_file_per_rank_per_attempt(job):
    log_dir = job.dir / "logs"
    r = job.run("--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(log_dir),
                worker("talker.py"), env={"FAIL_FIRST": "1"})
    assert r.rc == 0, r.err
    for attempt in (0, 1):
        for rank in (0, 1):
            d = log_dir / f"attempt_{attempt}" / f"rank_{rank}"
            assert (d / "stdout.log").read_text() == f"out {rank} attempt {attempt}\n"  # raw, no prefix
            assert (d / "stderr.log").read_text() == f"err {rank} attempt {attempt}\n"
    assert "[rank 1] out 1 attempt 1" in r.out  # --log-dir alone also keeps the console


def test_tee_and_redirects_per_stream_and_local_rank(job):
    log_dir = job.dir / "logs"
    # local rank 0: stdout to file only; local rank 1: stderr to file and console
    r = job.run("--standalone", "--nproc-per-node", "2", "--log-dir", str(log_dir), "--redirects", "0:1",
                "--tee", "1:2", worker("talker.py"))
    assert r.rc == 0, r.err
    d0, d1 = log_dir / "attempt_0" / "rank_0", log_dir / "attempt_0" / "rank_1"
    assert (d0 / "stdout.log").read_text() == "out 0 attempt 0\n" and not (d0 / "stderr.log").exists()
    assert (d1 / "stderr.log").read_text() == "err 1 attempt 0\n" and not (d1 / "stdout.log").exists()
    assert r.out.splitlines() == ["[rank 1] out 1 attempt 0"]  # rank 0's stdout went to its file only
    assert "[rank 0] err 0 attempt 0" in r.err and "[rank 1] err 1 attempt 0" in r.err


def test_redirects_without_log_dir_keeps_the_files_in_a_temporary_directory(job):
    r = job.run("--standalone", "--nproc-per-node", "1", "--redirects", "3", worker("talker.py"))
    assert r.rc == 0, r.err
    assert r.out == ""
    (run_dir,) = [p for p in job.dir.iterdir() if p.name.startswith("plait-run-")]
    assert (run_dir / "attempt_0" / "rank_0" / "stdout.log").read_text() == "out 0 attempt 0\n"


def test_local_ranks_filter_limits_the_console_only(job):
    log_dir = job.dir / "logs"
    r = job.run("--standalone", "--nproc-per-node", "3", "--local-ranks-filter", "0,2", "--tee", "3",
                "--log-dir", str(log_dir), worker("talker.py"))
    assert r.rc == 0, r.err
    assert sorted(r.out.splitlines()) == ["[rank 0] out 0 attempt 0", "[rank 2] out 2 attempt 0"]
    assert "err 1" not in r.err
    assert (log_dir / "attempt_0" / "rank_1" / "stdout.log").read_text() == "out 1 attempt 0\n"


def test_prefix_template(job):
    r = job.run("--standalone", "--nproc-per-node", "2", "--role", "tr", "--log-line-prefix-template",
                "${role_name}${local_rank}|", worker("talker.py"))
    assert r.rc == 0, r.err
    assert sorted(r.out.splitlines()) == ["tr0|out 0 attempt 0", "tr1|out 1 attempt 0"]


def test_successful_run_removes_its_temporary_directory(job):
    r = job.run("--standalone", "--nproc-per-node", "1", worker("talker.py"))
    assert r.rc == 0, r.err
    assert not [p for p in job.dir.iterdir() if p.name.startswith("plait-run-")]


def test_a_partial_line_is_ended_before_another_ranks_line():
    """Rank 1's partial line (shown after the idle flush) then rank 0's whole line: rank 0's goes
    on a line of its own, and the newline that later ends rank 1's is not a second, empty line
    (under load a ranks' lines were seen joined: "[rank 1] a[rank 0] b"); a continuation with
    text comes prefixed on its own line. Pure logic: the pump's console writer, no process."""
    import io

    from plait.run.logs import LogPump, _Stream

    console = io.BytesIO()
    pump = LogPump(on_eof=lambda: None)
    r0, r1 = (_Stream(fd, f"[rank {fd}] ".encode(), console, None) for fd in (0, 1))
    pump._to_console(r1, b"hello from rank 1")
    pump._to_console(r0, b"hello from rank 0\n")
    pump._to_console(r1, b"\n")
    assert console.getvalue() == b"[rank 1] hello from rank 1\n[rank 0] hello from rank 0\n"
    pump._to_console(r1, b"50%")
    pump._to_console(r0, b"x\n")
    pump._to_console(r1, b" done\nnext\n")
    assert console.getvalue().splitlines()[2:] == [b"[rank 1] 50%", b"[rank 0] x", b"[rank 1]  done", b"[rank 1] next"]
    pump._to_console(r0, b"a")  # one rank alone: its partial line is continued, unprefixed
    pump._to_console(r0, b"b\n")
    assert console.getvalue().splitlines()[-1] == b"[rank 0] ab"
