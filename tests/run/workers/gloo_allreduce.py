"""A real Gloo process group: all-reduce, check, and (CRASH_RANK in attempt 0) crash, then again.

Every attempt all-reduces rank+1 over the world and checks the sum; rank CRASH_RANK crashes
hard (os._exit) after the first attempt's all-reduce, once every rank has recorded it. The
restarted attempt must form a new group and all-reduce again: the restart works with a real
process group."""

import os
import time

import _common
import torch
import torch.distributed as dist

_common.register()
t0 = time.time()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert (rank, world) == (_common.rank(), _common.world())
x = torch.full((4,), float(rank + 1))
dist.all_reduce(x)
expected = world * (world + 1) / 2
assert torch.equal(x, torch.full((4,), expected)), (x, expected)
_common.write(f"allreduce_a{_common.attempt()}_r{rank}", {"sum": x[0].item(), "world": world, "init_s": time.time() - t0})
print(f"all_reduce ok: attempt {_common.attempt()} rank {rank} sum {x[0].item():g}", flush=True)
if _common.attempt() == 0 and rank == int(os.environ.get("CRASH_RANK", "-1")):
    # every rank's first all-reduce on record before the crash stops them (on a loaded machine
    # the others may not have written theirs yet)
    for other in range(world):
        _common.wait_for(f"allreduce_a0_r{other}")
    os._exit(13)
dist.barrier()
dist.destroy_process_group()
