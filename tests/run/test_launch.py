"""Starting workers: the environment torchrun gives them, contiguous ranks, and clean success."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from plait.run import main
from plait.run.workers import own_group
from tests.run.conftest import HANG_S, REPO, worker


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_success_with_n_workers(job, nproc):
    r = job.run("--standalone", "--nproc-per-node", str(nproc), worker("env_dump.py"))
    assert r.rc == 0, r.err
    assert job.outputs("env_") == [f"env_a0_r{i}.json" for i in range(nproc)]
    lines = sorted(r.out.splitlines())
    assert lines == sorted(f"[rank {i}] hello from rank {i} of {nproc}" for i in range(nproc))


def test_every_worker_sees_torchruns_environment(job):
    r = job.run("--standalone", "--nproc_per_node=3", "--max-restarts", "2", "--role", "trainer",
                worker("env_dump.py"), "--lr", "0.1", "--local-rank=${local_rank}")
    assert r.rc == 0, r.err
    envs = [job.read(f"env_a0_r{i}.json") for i in range(3)]
    masters = {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}
    assert len(masters) == 1 and int(masters.pop()[1]) > 0
    run_ids = {e["PLAIT_RUN_ID"] for e in envs}
    assert len(run_ids) == 1 and run_ids == {e["TORCHELASTIC_RUN_ID"] for e in envs}
    for i, e in enumerate(envs):
        assert (e["RANK"], e["LOCAL_RANK"], e["ROLE_RANK"]) == (str(i), str(i), str(i))
        assert (e["GROUP_RANK"], e["ROLE_NAME"]) == ("0", "trainer")
        assert e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == e["ROLE_WORLD_SIZE"] == "3"
        assert e["GROUP_WORLD_SIZE"] == "1"
        assert e["PLAIT_RESTART_COUNT"] == e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["PLAIT_MAX_RESTARTS"] == e["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert e["TORCHELASTIC_ERROR_FILE"].endswith(os.path.join("attempt_0", f"rank_{i}", "error.json"))
        assert e["OMP_NUM_THREADS"] == "1"
        # the script runs as `python script.py args` would run it
        assert e["argv"][1:] == ["--lr", "0.1", f"--local-rank={i}"]  # torchrun's ${local_rank} macro
        assert e["name"] == "__main__" and e["file"] == worker("env_dump.py")
        assert e["path0"] == os.path.dirname(worker("env_dump.py"))
        # each leads its own process group; a session of its own only under a terminal (own_group)
        assert e["pgid"] == e["pid"]
        assert e["sid"] == (e["pid"] if "start_new_session" in own_group() else os.getsid(0))


def test_a_worker_gets_its_own_session_only_where_the_agent_has_a_terminal(monkeypatch):
    def no_terminal(path, flags):
        raise OSError(6, "No such device or address", path)

    monkeypatch.setattr(os, "open", no_terminal)
    assert own_group() == {"process_group": 0}
    monkeypatch.setattr(os, "open", lambda path, flags: os.dup(0))
    assert own_group() == {"start_new_session": True}


def test_virtual_local_rank_gives_each_worker_device_0_of_its_own(job):
    r = job.run("--standalone", "--nproc-per-node", "2", "--virtual-local-rank", worker("env_dump.py"),
                env={"CUDA_VISIBLE_DEVICES": "4,6"})
    assert r.rc == 0, r.err
    envs = [job.read(f"env_a0_r{i}.json") for i in range(2)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs] == [("0", "0", "4"), ("1", "0", "6")]


def test_module_mode_runs_like_python_dash_m(job):
    r = job.run("--standalone", "--nproc-per-node", "2", "-m", "tests.run.workers.module_main", "x")
    assert r.rc == 0, r.err
    assert sorted(r.out.splitlines()) == ["[rank 0] module rank 0 argv ['x']", "[rank 1] module rank 1 argv ['x']"]


def test_no_python_execs_the_program_and_record_writes_the_error_file(job, tmp_path):
    script = tmp_path / "recorded.py"
    script.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from plait.run import record\n"
        "@record\n"
        "def main():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise KeyError('recorded by @record')\n"
        "main()\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    r = job.run("--standalone", "--nproc-per-node", "2", "--no-python", str(script))
    assert r.rc == 1
    assert "message   : KeyError: 'recorded by @record'" in r.err
    assert "error_file: " + str(tmp_path) in r.err  # the file @record wrote, under TMPDIR
    assert 'raise KeyError' in r.err  # its traceback, in the summary


def test_plait_run_through_the_cli(job):
    r = subprocess.run([sys.executable, "-m", "plait", "run", "--standalone", "--nproc-per-node", "2",
                        worker("env_dump.py")], env=job.env(), cwd=job.dir, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[rank 0] hello from rank 0 of 2", "[rank 1] hello from rank 1 of 2"]


def test_help_lists_torchruns_flags(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--rdzv-endpoint", "--max-restarts", "--tee"):
        assert flag in out


def test_a_launch_that_outlives_its_bound_fails_with_every_process_stack(job):
    """The fixture's own promise: a hung launch fails the test with each process's Python stack
    (the agent's and its workers'), so a hang seen once in CI can be read, not guessed."""
    launch = job.start("--nproc-per-node", "2", worker("sleeper.py"))
    job.wait_for_outputs("ready_a0_r", 2)
    with pytest.raises(pytest.fail.Exception) as failed:
        launch.wait(timeout=0.5)
    text = str(failed.value)
    assert text.count("--- stacks of pid") == 3, text  # the agent and its two workers
    assert "sleeper.py\", line" in text and "in _watch" in text, text  # each one where it waits


def test_waiting_for_outputs_ends_when_every_launch_has_exited(job):
    """The fixture's wait fails as soon as no launch is left to write the outputs, with their exit
    codes and stderr, instead of polling out HANG_S (a rendezvous that gave up read as a hang)."""
    job.start("--nproc-per-node", "0", worker("elastic.py"))  # exits 2 at once, writes nothing
    with pytest.raises(pytest.fail.Exception, match=r"got \[\] \(every launch exited\)\n--- agent0.stderr "
                       r"\(exit code 2\)\n.*a node needs at least 1 worker"):
        job.wait_for_outputs("running_a0_", 1)
