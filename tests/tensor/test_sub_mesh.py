"""Ranks outside a sub-mesh (torch's non-participating ranks): they hold empty local tensors,
run no op and join no collective, while the members compute among themselves. The scenario
is torch's test_dtensor.py sub-mesh tests (mesh [0, 2] of a world of 4); the outsiders
leave each test at once, so a member waiting on them would hang, not pass."""

import torch

from plait import comm
from plait.device_mesh import DeviceMesh
from plait.tensor import DTensor, Replicate, Shard, distribute_tensor
from plait.tensor import ones as dt_ones
from plait.testing import distributed

EMPTY = torch.tensor([])


def _expect(mesh, inside, outside, value):
    want = inside if mesh._is_current_rank_part_of_mesh() else outside
    if isinstance(want, list):
        assert len(value) == len(want)
        for w, v in zip(want, value):
            assert torch.equal(v, w), (v, w)
    else:
        assert torch.equal(value, want), (value, want)


@distributed([4], timeout=60)
def test_from_local_and_ops_on_a_sub_mesh():
    mesh = DeviceMesh("cpu", [0, 2])
    assert mesh._is_current_rank_part_of_mesh() == (comm.global_rank() in (0, 2))
    dt = DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)])
    assert dt.shape == (6, 4) and dt.placements == (Shard(0),)
    _expect(mesh, torch.ones(3, 4), EMPTY, dt.to_local())
    dt = dt + 2  # only 0 and 2 compute
    _expect(mesh, torch.ones(3, 4) + 2, EMPTY, dt.to_local())
    assert dt.shape == (6, 4) and dt.placements == (Shard(0),)
    # a 0-dim result is a zero, a list result a list of empty pieces
    total = DTensor.from_local(torch.ones(4, 3), mesh, [Shard(0)]).sum()
    _expect(mesh, torch.tensor(12.0), torch.tensor(0.0), total.to_local())
    parts = DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)]).split([2, 2], dim=1)
    _expect(mesh, [torch.ones(3, 2)] * 2, [EMPTY] * 2, [p.to_local() for p in parts])


@distributed([4], timeout=60)
def test_redistribute_and_distribute_on_a_sub_mesh():
    mesh = DeviceMesh("cpu", [0, 2])
    sharded = DTensor.from_local(torch.ones(4, 3), mesh, [Shard(0)])
    replicated = sharded.redistribute(placements=[Replicate()])
    _expect(mesh, torch.ones(8, 3), EMPTY, replicated.to_local())
    again = replicated.redistribute(placements=[Shard(0)])
    _expect(mesh, torch.ones(4, 3), EMPTY, again.to_local())
    full = torch.arange(12.0).view(4, 3)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    mine = full[:2] if comm.global_rank() == 0 else full[2:]
    _expect(mesh, mine, EMPTY, dt.to_local())
    _expect(mesh, full, EMPTY, dt.full_tensor())
    _expect(mesh, torch.ones(2, 3), EMPTY, dt_ones(4, 3, device_mesh=mesh, placements=[Shard(0)]).to_local())
    # in-place ops on an outsider leave its empty piece as it is
    dt.add_(1)
    _expect(mesh, mine + 1, EMPTY, dt.to_local())
