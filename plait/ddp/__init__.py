"""plait.ddp — data parallel: every rank a full replica, gradients averaged in backward.

    model = DistributedDataParallel(model)              # torch.nn.parallel's wrapper
    replicate(model, device_mesh=mesh["dp"])            # or the composable form, in place
    loss = model(x).sum(); loss.backward()              # buckets all-reduced as they fill
    with model.no_sync(): model(x2).sum().backward()    # accumulate without communication
    with model.join(): ...                              # ranks with fewer batches

Files: `buckets` (grouping, flat buffers, GradBucket), `reducer` (hooks, overlap, end of
backward), `graph` (output pre-hooks, unused-parameter walk), `sync` (start-up and buffer
broadcasts), `replica` (what happens around forward), `distributed` / `replicate` (the two
front doors), `compiled` (under torch.compile: the module split at bucket boundaries),
`join` (uneven inputs), `comm_hooks` (fp16/bf16/PowerSGD).
"""

from plait.ddp import comm_hooks
from plait.ddp.buckets import GradBucket
from plait.ddp.distributed import DistributedDataParallel
from plait.ddp.join import Join, Joinable, JoinHook
from plait.ddp.replicate import replicate, replicate_state

DDP = DistributedDataParallel

__all__ = [
    "DDP", "DistributedDataParallel", "GradBucket", "Join", "JoinHook", "Joinable", "comm_hooks",
    "replicate", "replicate_state",
]
