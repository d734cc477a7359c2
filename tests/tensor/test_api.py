"""The DTensor API a torch user writes against: from_local / to_local / full_tensor,
distribute_tensor, distribute_module, the factories, and the errors that name what is
wrong. Values are small integers moved, never summed in a new order: compared exactly.
"""

import copy
import warnings

import pytest
import torch
from torch import nn

from plait import comm
from plait.debug import CommDebugMode
from plait.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    full,
    ones,
    rand,
    randn,
    zeros,
)
from plait.testing import assert_shard_close, chunk_sizes, distributed

from ._helpers import ints, mesh_for

EXACT = dict(atol=0, rtol=0)


@distributed([1, 2, 3, 4])
def test_from_local_to_local_full_tensor(world_size):
    mesh = mesh_for(world_size)
    rank = mesh.get_local_rank()
    # even shards: the global shape is inferred
    local = torch.full((2, 3), float(rank))
    x = DTensor.from_local(local, mesh, [Shard(0)])
    assert x.shape == (2 * world_size, 3) and x.placements == (Shard(0),) and x.device_mesh is mesh
    assert torch.equal(x.to_local(), local) and x.to_local().data_ptr() == local.data_ptr()  # no copy
    assert torch.equal(x.full_tensor(), torch.arange(world_size).repeat_interleave(2)[:, None].float().expand(-1, 3))
    # uneven shards: pass the shape, or let run_check gather the sizes
    sizes = chunk_sizes(7, world_size)
    full = ints(7, 3, seed=1)
    piece = full.split(sizes)[rank] if sizes[rank] else full[:0]
    for y in (DTensor.from_local(piece, mesh, [Shard(0)], shape=(7, 3)),
              DTensor.from_local(piece, mesh, [Shard(0)], run_check=True)):
        assert y.shape == (7, 3) and y.stride() == (3, 1)
        assert torch.equal(y.full_tensor(), full)
    # run_check broadcasts Replicate data from coordinate 0 and refuses a wrong piece
    z = DTensor.from_local(torch.full((2,), float(rank)), mesh, [Replicate()], run_check=True)
    assert torch.equal(z.to_local(), torch.zeros(2))
    if world_size > 1:
        bad = torch.zeros(3 if rank == 0 else 2, 4)
        with pytest.raises(ValueError, match="run_check"):
            DTensor.from_local(bad, mesh, [Shard(0)], shape=(2 * world_size, 4), run_check=True)
    # Partial: full_tensor reduces
    p = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    assert torch.equal(p.full_tensor(), torch.full((3,), float(world_size)))
    # from_local and to_local are differentiable; grads keep the placements
    leaf = torch.ones(2, 3, requires_grad=True)
    d = DTensor.from_local(leaf, mesh, [Shard(0)])
    (d.full_tensor() * 3).sum().backward()
    assert torch.equal(leaf.grad, torch.full((2, 3), 3.0))
    w = distribute_tensor(ints(4, 2, seed=2), mesh, [Shard(0)]).requires_grad_()
    (w.to_local() * 2).sum().backward()
    assert w.grad.placements == (Shard(0),) and torch.equal(w.grad.full_tensor(), torch.full((4, 2), 2.0))
    # each rank's local grad as one term of the total: Partial
    r = distribute_tensor(ints(4, 2, seed=2), mesh, [Replicate()]).requires_grad_()
    (r.to_local(grad_placements=[Partial()]) * 2).sum().backward()
    assert r.grad.placements == (Partial(),)
    assert torch.equal(r.grad.full_tensor(), torch.full((4, 2), 2.0 * world_size))


@distributed([1, 2, 3, 4])
def test_distribute_tensor_from_the_source_rank(world_size):
    mesh = mesh_for(world_size)
    rank = mesh.get_local_rank()
    truth = ints(7, 4, seed=3)
    mine = truth + rank  # every rank holds something else; rank 0 is the truth
    for placements in ([Shard(0)], [Shard(1)], [Replicate()], [Partial()], [Partial("max")]):
        x = distribute_tensor(mine, mesh, placements)
        assert isinstance(x, DTensor) and x.placements == tuple(placements) and x.shape == truth.shape
        torch.testing.assert_close(x.full_tensor(), truth, **EXACT)
        assert x.to_local().data_ptr() != mine.data_ptr() or x.to_local().numel() == 0
    if world_size > 1:
        src1 = distribute_tensor(mine, mesh, [Shard(0)], src_data_rank=1)
        torch.testing.assert_close(src1.full_tensor(), truth + 1, **EXACT)
        own = distribute_tensor(mine, mesh, [Shard(0)], src_data_rank=None)  # no communication
        assert_shard_close(own.to_local(), mine, group=mesh.get_group(), atol=0, rtol=0)
    with CommDebugMode() as mode:
        distribute_tensor(mine, mesh, [Shard(0)], src_data_rank=None)
    assert mode.get_total_counts() == 0
    leaf = distribute_tensor(torch.ones(3, requires_grad=True), mesh, [Shard(0)])
    assert leaf.requires_grad and leaf.is_leaf
    assert distribute_tensor(leaf, mesh, [Shard(0)]) is leaf
    with pytest.raises(ValueError, match="use redistribute"):
        distribute_tensor(leaf, mesh, [Replicate()])


@distributed([4])
def test_distribute_tensor_on_a_2d_mesh():
    mesh = mesh_for(4, two_d=True)
    truth = ints(7, 5, seed=4)
    mine = truth * (1 + comm.global_rank())
    for placements in ([Shard(0), Shard(0)], [Shard(0), Shard(1)], [Replicate(), Shard(1)],
                       [Partial(), Shard(0)], [Shard(1), Replicate()]):
        x = distribute_tensor(mine, mesh, placements)
        assert tuple(x.to_local().shape) == x._spec.local_shape
        torch.testing.assert_close(x.full_tensor(), truth, **EXACT)
    sub = mesh["b"]
    y = distribute_tensor(truth, sub, [Shard(0)])
    torch.testing.assert_close(y.full_tensor(), truth, **EXACT)


@distributed([2, 3])
def test_distribute_module(world_size):
    mesh = mesh_for(world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    model.register_buffer("scale", torch.ones(2))
    reference = copy.deepcopy(model)

    def partition(name, module, mesh):
        if name == "0":
            module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(0)]))

    def input_fn(module, inputs, mesh):
        return tuple(distribute_tensor(t, mesh, [Replicate()]) for t in inputs)

    def output_fn(module, outputs, mesh):
        return outputs.full_tensor()

    distribute_module(model, mesh, partition, input_fn, output_fn)
    assert model[0].weight.placements == (Shard(0),) and model[0].bias.placements == (Replicate(),)
    assert isinstance(model[2].weight, nn.Parameter) and isinstance(model[2].weight, DTensor)
    assert isinstance(model.scale, DTensor)
    x = ints(3, 4, seed=5)
    out = model(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, reference(x))
    out.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad.full_tensor(), reference[0].weight.grad)
    with pytest.raises(RuntimeError, match="already applied"):
        distribute_module(model, mesh)
    plain = distribute_module(nn.Linear(2, 2), mesh)  # default: replicate everything
    assert all(p.placements == (Replicate(),) for p in plain.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribute_module(nn.Linear(2, 2), mesh, input_fn=lambda inputs, mesh: inputs)
    assert any(issubclass(w.category, FutureWarning) for w in caught)


@distributed([1, 3])
def test_factories_match_a_single_process_run(world_size):
    mesh = mesh_for(world_size)
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        assert torch.equal(zeros(5, 3, device_mesh=mesh, placements=placements).full_tensor(), torch.zeros(5, 3))
        assert torch.equal(ones((5, 3), device_mesh=mesh, placements=placements).full_tensor(), torch.ones(5, 3))
        f = full((5, 3), 2.5, device_mesh=mesh, placements=placements, dtype=torch.bfloat16)
        assert f.dtype == torch.bfloat16 and torch.equal(f.full_tensor(), torch.full((5, 3), 2.5, dtype=torch.bfloat16))
        for draw, factory in ((torch.rand, rand), (torch.randn, randn)):
            torch.manual_seed(11)
            expected = draw(5, 3)
            torch.manual_seed(11)
            got = factory(5, 3, device_mesh=mesh, placements=placements, requires_grad=True)
            assert got.requires_grad and torch.equal(got.full_tensor(), expected)
    with pytest.raises(ValueError, match="cannot be Partial"):
        zeros(2, device_mesh=mesh, placements=[Partial()])


@distributed([2])
def test_errors_repr_and_copies():
    mesh = mesh_for(2)
    x = distribute_tensor(ints(4, 3, seed=6), mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"torch.Tensor of shape \(4, 3\) mixed with DTensors"):
        x + torch.ones(4, 3)
    assert torch.equal((x + torch.tensor(1.0)).full_tensor(), ints(4, 3, seed=6) + 1)  # 0-dim mixes
    with pytest.raises(TypeError, match="takes a torch.Tensor, got a DTensor"):
        DTensor.from_local(x, mesh, [Shard(0)])
    with pytest.raises(ValueError, match="stride without a shape"):
        DTensor.from_local(torch.ones(2), mesh, [Shard(0)], stride=(1,))
    assert repr(x).startswith("DTensor(local_tensor=tensor(") and "placements=(Shard(dim=0),)" in repr(x)
    y = copy.deepcopy(x)
    assert y.placements == x.placements and torch.equal(y.full_tensor(), x.full_tensor())
    assert y.to_local().data_ptr() != x.to_local().data_ptr()
    other = mesh_for(2)
    assert other == mesh
    # a DTensor on another mesh: one of the same ranks and names still mixes (equal meshes)
    z = distribute_tensor(ints(4, 3, seed=6), other, [Shard(0)])
    assert torch.equal((x + z).full_tensor(), 2 * ints(4, 3, seed=6))
    assert x.sum().item() == ints(4, 3, seed=6).sum().item()
    assert torch.equal(x, z) and not torch.equal(x, z + 1)
    assert x.is_same_size(z)


@distributed([4])
def test_a_result_keeps_its_inputs_mesh_when_an_equal_mesh_ran_the_op_first(world_size):
    """Meshes over the same ranks compare equal, but each has its own root: an op's cached
    plan must not hand a result the mesh of an earlier, equal one (fully_shard over TP then
    saw a tp mesh from another root and refused it)."""
    from plait.device_mesh import DeviceMesh, init_device_mesh

    first = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    second = DeviceMesh("cpu", first._root.mesh, mesh_dim_names=("dp", "tp"))["tp"]
    assert first == second and first._root is not second._root
    for mesh in (first, second):
        x = distribute_tensor(torch.arange(8.0).view(4, 2), mesh, [Shard(0)])
        y = x * 2
        assert y.device_mesh is mesh and (y + y).device_mesh is mesh
