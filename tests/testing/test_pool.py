"""The multi-rank harness: results per rank, reuse, and failures that say where and why."""

import os
import time

import pytest
import torch

from plait import comm
from plait.testing import DistributedTestError, pool, run_distributed


def _rank_and_pid():
    print("hello")
    return comm.global_rank(), os.getpid()


def _raise_on_rank_1_others_wait():
    g = comm.world_group()
    if comm.get_rank(g) == 1:
        raise ValueError("planted failure on rank 1")
    comm.all_reduce(torch.ones(1), group=g)  # waits for rank 1, which never comes


def _sleep_forever_on_rank_0():
    if comm.global_rank() == 0:
        time.sleep(3600)


def _exit_on_rank_2():
    if comm.global_rank() == 2:
        os._exit(3)


def _leak_state():
    torch.set_default_dtype(torch.float64)
    comm.add_listener(comm.CommListener())


def _state():
    return torch.get_default_dtype(), len(comm.listeners())


def _compile_imports():
    import sys

    before = set(sys.modules)
    compiled = torch.compile(lambda x: (x * 2).sin().sum(), backend="aot_eager", fullgraph=True)
    compiled(torch.ones(3, requires_grad=True)).backward()
    torch._dynamo.reset()
    return sorted(set(sys.modules) - before)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_results_per_rank_and_the_pool_is_reused(capsys):
    first = run_distributed(_rank_and_pid, world_size=3)
    assert [r for r, _ in first] == [0, 1, 2]
    assert run_distributed(_rank_and_pid, world_size=3) == first, "same processes serve the next call"
    assert "[rank 2] hello" in capsys.readouterr().out


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="on a build with CUDA the forkserver does not warm "
                    "Dynamo (CUDA and autograd's device threads do not survive a fork)")
def test_a_fresh_rank_compiles_without_importing_anything():
    """The forkserver ran Dynamo once before forking (plait/testing/_forkserver.py), so a
    rank's first torch.compile finds every module it needs already imported."""
    if 1 in pool._pools:
        pool._pools[1].close()  # a rank that has compiled nothing yet
    assert run_distributed(_compile_imports, world_size=1) == [[]]


def test_state_does_not_leak_between_tests():
    run_distributed(_leak_state, world_size=2)
    assert run_distributed(_state, world_size=2) == [(torch.float32, 0)] * 2


def test_an_exception_names_the_rank_and_line_and_stops_the_waiters():
    pids = [pid for _, pid in run_distributed(_rank_and_pid, world_size=3)]
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_1_others_wait, world_size=3, timeout=120)
    # the others are stopped after the grace, not left to the 120 s timeout (the rest is slack
    # for collecting stacks and stopping processes on a loaded machine)
    assert time.monotonic() - start < pool.ERROR_GRACE_S + 25
    text = str(info.value)
    assert "failed on ranks [1] of 3; ranks [0, 2] were still running" in text
    assert "ValueError: planted failure on rank 1" in text and "test_pool.py" in text
    assert "rank 0: Python stack when stopped" in text and "_raise_on_rank_1_others_wait" in text
    assert not any(_alive(p) for p in pids), "a failed pool leaves no process behind"
    assert [r for r, _ in run_distributed(_rank_and_pid, world_size=3)] == [0, 1, 2], "a fresh pool starts"


def test_a_hang_fails_with_every_ranks_stack():
    pids = [pid for _, pid in run_distributed(_rank_and_pid, world_size=2)]
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_sleep_forever_on_rank_0, world_size=2, timeout=3)
    assert time.monotonic() - start < 3 + 25  # the 3 s timeout, then stacks and a stop under load
    text = str(info.value)
    assert "did not finish within 3 s on ranks [0] of 2" in text
    assert "rank 0: Python stack when stopped" in text and "_sleep_forever_on_rank_0" in text
    assert not any(_alive(p) for p in pids)


def test_a_dead_worker_is_reported_with_its_exit_code():
    with pytest.raises(DistributedTestError, match="worker died with exit code 3"):
        run_distributed(_exit_on_rank_2, world_size=4, timeout=60)


def test_world_size_is_checked():
    with pytest.raises(ValueError, match=r"world_size 0 is not in \[1, 64\]"):
        run_distributed(_rank_and_pid, world_size=0)
