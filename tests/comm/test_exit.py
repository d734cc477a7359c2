"""A job that finished its work exits 0, without Gloo's exit-time abort (pytorch#190489).

The mechanism (plait/comm/shutdown.py): a Gloo worker thread that needs the GIL after the
interpreter began finalizing is ended by CPython with pthread_exit, which calls
std::terminate ("terminate called without an active exception", exit code 134). The first
test runs a script in which an op completes while finalization is held open and its
future's Python callback must run on the worker: through plait it exits cleanly. (The same
script in pure torch, TORCH below, aborted in 2 of 3 runs under load and 0 of 2 on a quieter
machine: timing-dependent, so it is not a test here. Through plait with the exit hook
disabled it aborted too.) The next runs four README examples and the module-level-group
pattern under both launchers.

N = 1 run per (script, launcher) here, to keep the suite's time; the 20-runs-each figures,
under load, are in the issue's closing note. A failure is never rerun.
"""

import functools
import os
import socket
import subprocess
import sys
import textwrap

from tests import torchrun
from tests.test_readme import _run as run_examples
from tests.test_readme import plait_run_failures, readme_jobs

ABORT = "terminate called"

# Rank 1 joins the all-reduce 2 s late; rank 0 has left its script by then and holds its
# finalization open for 6 s (a slow __del__), so the op completes, and its future's callback
# needs the GIL, while rank 0 finalizes.
LATE_OP = textwrap.dedent("""
    import time, torch
    {init}
    if rank == 1:
        time.sleep(2)
    work = {op}
    work.get_future().then(lambda fut: None)   # a Python callback: it runs on Gloo's worker
    class HoldsFinalizationOpen:
        def __del__(self):
            time.sleep(6)
    if rank == 0:
        holder = HoldsFinalizationOpen()
    print(f"rank {{rank}} done", flush=True)
""")
TORCH = LATE_OP.format(
    init="import torch.distributed as dist\ndist.init_process_group('gloo')\nrank = dist.get_rank()\ng = dist.group.WORLD",
    op="dist.all_reduce(torch.ones(4), group=g, async_op=True)")
# The same two processes also check what tests/comm/test_launch_env.py asserts: a group formed
# from RANK / WORLD_SIZE / MASTER_* alone (env://), on Gloo, all-reduces (one start for both).
FROM_ENV = ("t = torch.tensor([float(rank + 1)])\ncomm.all_reduce(t, group=g)\n"
            "print(f'rank {rank} backend {comm.group_info(g).backend} sum {t.item():.0f}', flush=True)")
PLAIT = LATE_OP.format(
    init="from plait import comm\ng = comm.init_process_group()          # everything from the environment\n"
         "rank = comm.get_rank(g)\n" + FROM_ENV,
    op="comm.all_reduce(torch.ones(4), group=g, async_op=True)")

# Groups, a mesh and a DDP model held at module level past destroy_process_group, as the
# README teaches; temporaries whose last reference may be Gloo's worker's.
MODULE_LEVEL_GROUPS = textwrap.dedent("""
    import torch
    from plait import comm
    from plait.ddp import DistributedDataParallel as DDP
    from plait.device_mesh import init_device_mesh
    comm.init_process_group()
    g = comm.world_group()
    mesh = init_device_mesh("cpu", (comm.get_world_size(g),), mesh_dim_names=("dp",))
    dp = mesh["dp"].get_group()
    model = DDP(torch.nn.Linear(8, 2))
    for _ in range(10):
        model(torch.randn(4, 8)).sum().backward()
        comm.all_reduce(torch.ones(1000), group=g)
        comm.all_gather(torch.ones(3), group=dp)
    comm.all_reduce(torch.ones(4), group=dp, async_op=True).wait()
    comm.destroy_process_group()
""")

TORCHRUN_README = ("comm", "mesh", "ddp", "pipeline")

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(script: str) -> list[tuple[int, str]]:
    """(exit code, output) of each of two ranks started with env:// by hand."""
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-c", script],
        env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    results = []
    try:
        for p in procs:
            out = p.communicate(timeout=300)[0]
            results.append((p.returncode, out))
    finally:
        for p in procs:
            p.kill()
    return results


@functools.cache
def plait_pair() -> list[tuple[int, str]]:
    """(exit code, output) of each rank running PLAIT: started once, asserted by both files."""
    return _two_ranks(PLAIT)


def test_plait_finishes_gloo_work_before_finalization():
    results = plait_pair()
    for rank, (rc, out) in enumerate(results):
        assert rc == 0 and ABORT not in out and f"rank {rank} done" in out, (rank, rc, out)


def test_readme_examples_and_module_level_groups_exit_cleanly_under_both_launchers(tmp_path):
    # torchrun runs the examples that each hold groups their own way (a world group, a mesh,
    # DDP, p2p): the later ones (FSDP, TP, checkpoint) hold them as these do, and run under
    # plait run in tests/test_readme.py (not twice in the suite). Each launch runs its scripts
    # through tests/readme_driver.py, one fork per script: a fork finalizes as a fresh
    # interpreter does (atexit, Gloo's threads started in it), so the abort would show the same
    # way, and the launches drop from six to two (torchrun 8 and 2 ranks); the module-level
    # script's plait run is test_readme's 2-rank launch (`plait_run_failures`, shared).
    readme = {k: v for k, v in readme_jobs().items() if k in TORCHRUN_README}
    module_level = {"module_level_groups": (MODULE_LEVEL_GROUPS, 2)}
    bad = {f"{name} under torchrun": out
           for name, out in run_examples({**module_level, **readme}, tmp_path, tuple(torchrun.ARGV)).items()}
    bad.update({f"{name} under plait run": out for name, out in plait_run_failures().items() if name in module_level})
    assert not bad, "\n".join(f"--- {name} did not exit 0 on every rank, or aborted:\n{out[-3000:]}"
                              for name, out in bad.items())


def test_dropped_keeps_only_works_that_have_not_completed(monkeypatch):
    from plait.comm import shutdown

    class Work:
        def __init__(self, done):
            self.done = done

        def is_completed(self):
            return self.done

    monkeypatch.setattr(shutdown, "_armed", True)
    monkeypatch.setattr(shutdown, "_in_flight", shutdown.collections.deque())
    monkeypatch.setattr(shutdown, "_prune_at", 64)
    works = [Work(i % 3 != 0) for i in range(200)]
    for w in works:
        shutdown.dropped(w)
    kept = list(shutdown._in_flight)
    assert all(w.done for w in works if w not in kept)
    assert {w for w in works if not w.done} <= set(kept) and len(kept) < 100


def test_the_exit_hook_sees_unwaited_ops_and_holds_no_waited_one(monkeypatch):
    """A Work holds its op's buffers: the hook must know every op not waited for (held or
    dropped by the script) and keep no Work of an op already waited for."""
    from plait.comm import shutdown
    from plait.comm.work import Handle

    class Work:
        def __init__(self):
            self.done = False

        def is_completed(self):
            return self.done

        def wait(self):
            self.done = True

    monkeypatch.setattr(shutdown, "_armed", True)
    monkeypatch.setattr(shutdown, "_live", shutdown.weakref.WeakSet())
    monkeypatch.setattr(shutdown, "_in_flight", shutdown.collections.deque())
    held, dropped, waited = Work(), Work(), Work()
    handles = [Handle(w, lambda: None) for w in (held, dropped, waited)]
    for h in handles:
        shutdown.track(h)
    handles[2].wait()
    assert handles[2]._work is None, "a waited handle keeps no Work"
    del handles[1]  # dropped unwaited: its Work is kept until it completes
    assert set(map(id, shutdown.pending_works())) == {id(held), id(dropped)}
    held.done = dropped.done = True
    del handles
    assert all(w.is_completed() for w in shutdown.pending_works())


def test_a_running_native_thread_is_not_taken_as_parked():
    import _thread
    import time

    from plait.comm.shutdown import wait_until_native_threads_park

    assert wait_until_native_threads_park(5.0)  # this process: nothing outside Python's threads runs
    stop = []

    def spin():
        while not stop:
            pass

    _thread.start_new_thread(spin, ())  # not in threading's list, as a C++ thread would not be
    try:
        t0 = time.monotonic()
        assert not wait_until_native_threads_park(0.2)
        assert time.monotonic() - t0 >= 0.2
    finally:
        stop.append(1)
    time.sleep(0.1)
    assert wait_until_native_threads_park(5.0)
