"""Uneven inputs: `join()` gives what torch's DDP join gives.

The last rank has 2 batches fewer than the others. Both torch's
`torch.nn.parallel.DistributedDataParallel` (with its own Join) and plait's train the same
CNN with BatchNorm (so buffers take part: broadcast from a rank still training, and the
final model taken from the last rank to join) from the same start on the same batches;
the end states must agree. Joined ranks contribute zero gradients; by default both
divide by the initial world size, with divide_by_initial_world_size=False by the number
of ranks still training; a registered comm hook divides as it likes (allreduce_hook: by
the group size); find_unused_parameters and static_graph add their used-parameter
all-reduce, which joined ranks must shadow too.

Tolerance atol 1e-6 / rtol 1e-5 (float32): both scale by 1/N and sum with Gloo, but
their buckets differ in the first iteration (torch starts with one bucket), and Gloo's
ring adds a chunk's elements in an order that depends on the chunk boundaries: rounding,
over 5 steps. A joined rank counted wrongly in the divisor would be off by 1/N.
"""

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from plait.ddp import DistributedDataParallel, Join, replicate
from plait.ddp.comm_hooks import default_hooks
from plait.testing import assert_synced, distributed
from tests.ddp.common import PER_RANK, batch, build, loss_fn, world

STEPS = 5


def train_with_join(ddp, model, rank, n, **join_kwargs):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    my_steps = STEPS - 2 if rank == n - 1 else STEPS
    with ddp.join(**join_kwargs):
        for step in range(my_steps):
            x, y = batch("cnn_bn", step, n * PER_RANK)
            loss_fn("cnn_bn", ddp(x[rank * PER_RANK:(rank + 1) * PER_RANK]), y[rank * PER_RANK:(rank + 1) * PER_RANK]).backward()
            opt.step()
            opt.zero_grad()
    return model


@distributed([2, 3])
@pytest.mark.parametrize("mode", ["divide_by_initial_world_size", "divide_by_non_joined", "comm_hook",
                                  "find_unused_parameters", "static_graph"])
def test_join_with_uneven_batches_matches_torch(mode):
    g, rank, n = world()
    join_kwargs = {"divide_by_initial_world_size": mode != "divide_by_non_joined"}
    ddp_kwargs = {mode: True} if mode in ("find_unused_parameters", "static_graph") else {}
    ours = build("cnn_bn", seed=rank)
    theirs = build("cnn_bn", seed=rank)
    ddp = DistributedDataParallel(ours, bucket_cap_mb=0.00005, **ddp_kwargs)
    torch_ddp = TorchDDP(theirs, bucket_cap_mb=0.00005, **ddp_kwargs)
    if mode == "comm_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        torch_ddp.register_comm_hook(None, torch_hooks.allreduce_hook)
    train_with_join(ddp, ours, rank, n, **join_kwargs)
    train_with_join(torch_ddp, theirs, rank, n, **join_kwargs)
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        assert_synced(a, g, name=name)  # the post-hook gave every rank the last joiner's model
    ddp(torch.randn(PER_RANK, 2, 5, 5)).sum().backward()  # after the Join: plain DDP again


@distributed([2, 3])
def test_throw_on_early_termination_stops_every_rank():
    g, rank, n = world()
    ddp = DistributedDataParallel(build("mlp", seed=0))
    x = torch.randn(PER_RANK, 6)
    with pytest.raises(RuntimeError, match="exhausted"):
        with ddp.join(throw_on_early_termination=True):
            for _ in range(3 - (rank == n - 1)):
                ddp(x).sum().backward()


@distributed([2])
def test_replicated_module_joins_too():
    g, rank, n = world()
    model = replicate(build("mlp", seed=rank))
    with Join([model]):
        for _ in range(3 + rank):
            model(torch.randn(PER_RANK, 6)).sum().backward()
    for name, p in model.named_parameters():
        assert_synced(p, g, name=name)
