"""Planted faults, run as real rank processes: `python tests/debug/scenarios.py NAME`.

Each rank gets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT and the PLAIT_* debug
variables from the test (see jobs.py). A line a report must point at carries a
`# FAULT:<name>` marker; `fault_line(name)` finds it, so the tests never hard-code lines.
Only torch is imported at the top: the `raw_torch` scenario must not import plait itself.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist


def fault_line(name: str) -> int:
    """The line number of the `# FAULT:<name>` marker in this file."""
    with open(__file__) as f:
        for number, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# FAULT:{name}"):
                return number
    raise LookupError(f"no '# FAULT:{name}' marker in {__file__}")


def extra_all_reduce(rank: int, world: int) -> None:
    from plait import comm

    g = comm.world_group()
    x = torch.ones(4)
    for _ in range(2):
        comm.all_reduce(x, group=g)
    if rank == 0:
        comm.all_reduce(x, group=g)  # FAULT:extra_all_reduce


def send_without_recv(rank: int, world: int) -> None:
    """Two pipeline stages: stage 0 sends two microbatches, stage 1 receives only one."""
    from plait import comm

    g = comm.world_group()
    act = torch.arange(6.0).view(2, 3)
    if rank == 0:
        comm.send(act, dst=1, group=g)
        comm.send(act + 1, dst=1, group=g)  # FAULT:send_without_recv
    else:
        comm.recv(torch.empty(2, 3), src=0, group=g)
    comm.barrier(group=g)  # FAULT:send_without_recv_barrier


def sleeper(rank: int, world: int) -> None:
    from plait import comm

    g = comm.world_group()
    x = torch.ones(8)
    comm.all_reduce(x, group=g)
    if rank == world - 1:
        time.sleep(float(os.environ["SLEEP_S"]))  # FAULT:sleeper
    comm.all_reduce(x, group=g)  # FAULT:sleeper_all_reduce


def signal_dump(rank: int, world: int) -> None:
    """Rank 0 waits in an all-reduce that rank 1 never joins; the test sends SIGUSR1 to both."""
    from plait import comm

    g = comm.world_group()
    comm.all_reduce(torch.ones(2), group=g)
    if rank == 1:
        print(f"READY {rank}", flush=True)
        time.sleep(120)  # FAULT:signal_dump_sleep
    work = comm.all_reduce(torch.ones(2), group=g, async_op=True)  # FAULT:signal_dump
    print(f"READY {rank}", flush=True)  # only once the op is in flight: the test signals then
    work.wait()


def raw_torch(rank: int, world: int) -> None:
    """A script that never imports plait: only the bootstrap on PYTHONPATH can debug it."""
    dist.all_reduce(torch.ones(3))
    n = 4 if rank == 0 else 5
    dist.all_reduce(torch.ones(n))  # FAULT:raw_torch


def correct(rank: int, world: int) -> None:
    """A correct program: INFO prints a summary at exit; nothing else is said."""
    from plait import comm

    g = comm.world_group()
    for _ in range(3):
        comm.all_reduce(torch.ones(4), group=g)
    comm.all_gather(torch.ones(2), group=g)
    dist.barrier()
    print(f"DONE {rank}", flush=True)


SCENARIOS = {f.__name__: f for f in (extra_all_reduce, send_without_recv, sleeper, signal_dump, raw_torch, correct)}


def main() -> None:
    name = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if name != "raw_torch":  # plait's import, in each rank's own time, before init lines the ranks up:
        import plait.comm  # noqa: F401 - an import on a loaded machine must not eat the op's timeout
    if "STORE_HOST" in os.environ:  # the store served by that rank, not by rank 0 as env:// does
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=rank == int(os.environ["STORE_HOST"]))
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    SCENARIOS[name](rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
