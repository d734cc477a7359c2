"""distribute_tensor and distribute_module on meta tensors, as torch's: meta in, meta DTensor
out, every rank cutting its own local piece of the global shape without communication
(torch's test_api.py test_distribute_module_meta and test_dtensor.py's meta tests)."""

import torch
import torch.distributed.device_mesh as torch_mesh
import torch.distributed.tensor as torch_dt
from torch import nn

from plait.debug import CommDebugMode
from plait.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from plait.testing import distributed

from ._helpers import mesh_for


@distributed([2])
def test_distribute_tensor_on_meta_matches_torch(world_size):
    mesh = mesh_for(world_size, two_d=False)
    reference = torch_mesh.init_device_mesh("cpu", (world_size,))  # the world group: no new group
    for placements in ([Shard(0)], [Shard(1)], [Replicate()], [Partial()]):
        meta = torch.empty(5, 3, device="meta")
        with CommDebugMode() as mode:
            dt = distribute_tensor(meta, mesh, placements)
        assert mode.get_total_counts() == 0, "a meta tensor has no data to send"
        want = torch_dt.distribute_tensor(meta, reference, [_torch(p) for p in placements])
        assert dt.is_meta and dt.to_local().is_meta
        assert dt.shape == want.shape and dt.placements == tuple(placements)
        assert dt.to_local().shape == want.to_local().shape, placements


@distributed([2])
def test_distribute_module_on_meta(world_size):
    mesh = mesh_for(world_size, two_d=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))

    def shard_first(name, module, mesh):
        if name == "0":
            module.weight = nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(0)]))

    distribute_module(model, mesh, shard_first)
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) and p.is_meta for p in params.values())
    assert params["0.weight"].placements == (Shard(0),) and params["0.weight"].to_local().shape == (3, 4)
    assert params["2.weight"].placements == (Replicate(),) and params["2.weight"].to_local().shape == (2, 6)


def _torch(p):
    return {Shard: lambda: torch_dt.Shard(p.dim), Replicate: torch_dt.Replicate,
            Partial: torch_dt.Partial}[type(p)]()
