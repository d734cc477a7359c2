"""Smaller behaviours torch's DTensor tests rely on (issue 52's group 7): a DTensor saved with
torch.save loads back on its mesh's groups, DeviceMesh as a context manager, and torch's
texts where its tests match them."""

import io
import warnings

import pytest
import torch
from torch import nn

from plait.device_mesh import DeviceMesh, init_device_mesh
from plait.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from plait.testing import distributed

from ._helpers import mesh_for


@distributed([2])
def test_dtensor_round_trips_through_torch_save(world_size):
    mesh = mesh_for(world_size)
    full = torch.arange(6.0).view(3, 2)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    buf = io.BytesIO()
    torch.save({"w": dt}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)["w"]
    assert type(back) is DTensor and back.placements == (Shard(0),) and back.shape == (3, 2)
    assert torch.equal(back.to_local(), dt.to_local())
    assert back.device_mesh == mesh and back.device_mesh.get_group() is mesh.get_group(), \
        "the loaded mesh uses the groups this process already has"
    assert torch.equal(back.full_tensor(), full)


@distributed([2])
def test_mesh_as_context_manager(world_size):
    mesh = mesh_for(world_size)
    full = torch.arange(4.0)
    with mesh as entered:
        assert entered is mesh
        dt = distribute_tensor(full, placements=[Shard(0)])
        again = DTensor.from_local(dt.to_local(), placements=[Shard(0)])
    assert dt.device_mesh is mesh and again.device_mesh is mesh
    assert torch.equal(again.full_tensor(), full)
    with pytest.raises(RuntimeError, match="No device mesh is currently active"):
        distribute_tensor(full, placements=[Shard(0)])


@distributed([2])
def test_torch_texts(world_size):
    mesh = mesh_for(world_size)
    with pytest.raises(ValueError, match="must have the same length"):
        distribute_tensor(torch.ones(2, 2), DeviceMesh("cpu", [[0], [1]]), [Shard(0)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribute_module(nn.Linear(2, 2), mesh, input_fn=lambda inputs, device_mesh: inputs)
    assert any(str(w.message).startswith("Deprecating input_fn that takes two arguments") for w in caught)


@distributed([2])
def test_from_local_run_check_refuses_ranks_that_disagree_on_dtype_grad_or_stride():
    mesh = init_device_mesh("cpu", (2,))
    rank = mesh.get_rank()
    bad = {
        "dtype": torch.zeros(4, 3, dtype=torch.float32 if rank == 0 else torch.float64),
        "requires_grad": torch.zeros(4, 3, requires_grad=rank == 0),
        "stride": torch.zeros(4, 3) if rank == 0 else torch.zeros(3, 4).t(),
    }
    for what, local in bad.items():
        with pytest.raises(ValueError, match=f"Inconsistent tensor metadata.*differ in {what}"):
            DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
    # uneven pieces are fine (their shapes and strides differ as torch.chunk cuts them)
    d = DTensor.from_local(torch.zeros(3 - rank, 2), mesh, [Shard(0)], run_check=True)
    assert d.shape == (5, 2)


@distributed([2, 3])
def test_dist_and_histc_of_shards_are_partial(world_size):
    """torch's placements: each rank reduces its piece, one all-reduce when the value is read."""
    from plait.tensor import Partial
    from plait.tensor.placement import _NormPartial

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    a, b = torch.randn(7, 3), torch.randn(7, 3)
    da, db = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)])
    for p in (1.0, 2.0, float("inf")):
        d = torch.dist(da, db, p)
        assert d.placements == (_NormPartial(p),)
        torch.testing.assert_close(d.full_tensor(), torch.dist(a, b, p), atol=1e-5, rtol=1e-5)
    h = torch.histc(da, bins=5, min=-2, max=2)
    assert h.placements == (Partial("sum"),)
    assert torch.equal(h.full_tensor(), torch.histc(a, bins=5, min=-2, max=2))
    assert torch.histc(da, bins=5).placements == (Replicate(),)  # its range is the data's: gathered
