"""A job that destroys the default group and starts a new one (a test suite, a notebook, an
in-process restart) gets working groups and meshes, whichever library it re-inits through;
a group or mesh kept from before fails with an error that says so."""

import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from plait import comm
from plait.device_mesh import init_device_mesh
from plait.tensor import Replicate, Shard, distribute_tensor
from plait.testing import distributed

PG_TIMEOUT_S = 900.0  # the pool's: no collective of a later test may time out


def _reinit(via: str) -> None:
    """Destroy the default group and start another over the pool's store, under a fresh prefix."""
    tag = [None]
    if comm.global_rank() == 0:
        import uuid

        tag[0] = uuid.uuid4().hex
    dist.broadcast_object_list(tag, src=0)
    store = dist.PrefixStore(f"reinit/{tag[0]}", c10d._get_default_store())
    rank, world = dist.get_rank(), dist.get_world_size()
    if via == "torch":
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=PG_TIMEOUT_S))
    else:
        comm.destroy_process_group()
        comm.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=PG_TIMEOUT_S)


def _sum_of_ranks(group) -> int:
    t = torch.tensor([float(comm.global_rank())])
    comm.all_reduce(t, group=group)
    return int(t.item())


@pytest.mark.parametrize("via", ["torch", "plait"])
@distributed([4])
def test_reinit_gives_working_groups_and_old_ones_fail_clearly(via):
    rank = comm.global_rank()
    old = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    old_tp = old.get_group("tp")
    tp_ranks = [rank // 2 * 2, rank // 2 * 2 + 1]
    assert _sum_of_ranks(old_tp) == sum(tp_ranks)
    _reinit(via)
    # c10d names the new groups "0", "1", ... again: the cached facts of the old ones must not
    # answer for them
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    assert tp is not old_tp
    assert _sum_of_ranks(tp) == sum(tp_ranks)
    assert _sum_of_ranks(dp) == sum([rank % 2, rank % 2 + 2])
    assert _sum_of_ranks(comm.world_group()) == 6
    full = torch.arange(8.0).view(4, 2)
    dt = distribute_tensor(full, mesh, [Shard(0), Replicate()])
    assert torch.equal(dt.full_tensor(), full)
    # what was kept from before fails naming the group, on the rank that uses it
    with pytest.raises(comm.StaleGroupError, match=r"process group '.*' \(size 2\) was destroyed"):
        comm.all_reduce(torch.ones(1), group=old_tp)
    with pytest.raises(comm.StaleGroupError, match="was destroyed"):
        distribute_tensor(full, old, [Shard(0), Replicate()])


@distributed([4])
def test_a_group_destroyed_alone_fails_clearly():
    rank = comm.global_rank()
    pair = [rank // 2 * 2, rank // 2 * 2 + 1]
    group = comm.new_group(pair)
    assert _sum_of_ranks(group) == sum(pair)
    dist.destroy_process_group(group)
    with pytest.raises(comm.StaleGroupError, match="was destroyed"):
        comm.all_reduce(torch.ones(1), group=group)
    with pytest.raises(comm.StaleGroupError, match=re.escape(f"global ranks {pair} was destroyed on its own")):
        comm.new_group(pair)
    _reinit("torch")  # a new life makes the group again (and leaves the pool's ranks clean)
    assert _sum_of_ranks(comm.new_group(pair)) == sum(pair)
