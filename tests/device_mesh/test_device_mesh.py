"""DeviceMesh: shape, coordinates, groups per axis, slicing and flattening, errors."""

import pytest
import torch

from plait import comm
from plait.device_mesh import DeviceMesh, init_device_mesh
from plait.testing import distributed


def _ranks(group):
    return list(comm.group_info(group).ranks)


def _all_reduce_rank(group):
    t = torch.tensor([float(comm.global_rank())])
    comm.all_reduce(t, group=group)
    return int(t.item())


@distributed([8])
def test_2x2x2_mesh_every_slice_and_flatten():
    rank = comm.global_rank()
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp, dp, tp = rank // 4, (rank // 2) % 2, rank % 2
    assert mesh.shape == (2, 2, 2) and mesh.ndim == 3 and mesh.size() == 8
    assert mesh.get_coordinate() == [pp, dp, tp]
    assert [mesh.get_local_rank(a) for a in ("pp", "dp", "tp")] == [pp, dp, tp]
    assert mesh.size("tp") == 2 and mesh.size(0) == 2
    expected = {
        "pp": [dp * 2 + tp, 4 + dp * 2 + tp],
        "dp": [pp * 4 + tp, pp * 4 + 2 + tp],
        "tp": [pp * 4 + dp * 2, pp * 4 + dp * 2 + 1],
    }
    for axis, ranks in expected.items():
        g = mesh.get_group(axis)
        assert _ranks(g) == ranks, axis
        assert comm.get_rank(g) == mesh.get_local_rank(axis)
        assert _all_reduce_rank(g) == sum(ranks)
        sub = mesh[axis]
        assert sub.ndim == 1 and sub.mesh.tolist() == ranks and sub.get_group() is g, "one group per slice"
    two = mesh["dp", "tp"]
    assert two.shape == (2, 2) and two.mesh.tolist() == [[pp * 4, pp * 4 + 1], [pp * 4 + 2, pp * 4 + 3]]
    assert two.get_group("tp") is mesh.get_group("tp") and two["tp"].get_group() is mesh.get_group("tp")
    assert mesh["pp", "tp"].mesh.tolist() == [[dp * 2, dp * 2 + 1], [4 + dp * 2, 4 + dp * 2 + 1]]
    flat = two.flatten("dp_tp")
    assert flat.mesh.tolist() == [pp * 4 + i for i in range(4)] and flat.mesh_dim_names == ("dp_tp",)
    assert flat.get_local_rank() == dp * 2 + tp
    assert _all_reduce_rank(flat.get_group()) == sum(range(pp * 4, pp * 4 + 4))
    assert mesh["dp_tp"].get_group() is flat.get_group(), "flattened axis reachable from the root"
    assert mesh["pp", "dp_tp"].shape == (2, 4)
    assert mesh["pp", "tp"]._flatten().mesh_dim_names == ("pp_tp",), "torch's spelling works too"
    everything = mesh.flatten("world")
    assert everything.get_group() is comm.world_group()
    groups = torch.distributed.get_pg_count()
    again = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    assert again == mesh and again["dp", "tp"].flatten("dp_tp").get_group() is flat.get_group()
    assert torch.distributed.get_pg_count() == groups, "rebuilding and reslicing creates no group"
    # Errors name what is wrong.
    with pytest.raises(KeyError, match="mesh has no axis 'ep'"):
        mesh["ep"]
    with pytest.raises(ValueError, match="must be named in the mesh's order"):
        mesh["tp", "dp"]
    with pytest.raises(ValueError, match="mesh has 3 axes"):
        mesh.get_group()
    with pytest.raises(ValueError, match="already used"):
        mesh["pp", "dp"].flatten("tp")


@distributed([8])
def test_mesh_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"mesh shape \(2, 2, 3\) = 12 != world_size 8"):
        init_device_mesh("cpu", (2, 2, 3))
    with pytest.raises(ValueError, match=r"mesh_dim_names \('dp', 'dp'\) repeat \['dp'\]"):
        init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "dp"))
    with pytest.raises(ValueError, match="has 1 names for a 2-D mesh"):
        init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match=r"lists global ranks \[1\] more than once"):
        DeviceMesh("cpu", [[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"mesh ranks \[9\] are not in \[0, world_size 8\)"):
        DeviceMesh("cpu", [0, 9])


@distributed([4])
def test_custom_mesh_subset_and_outsiders():
    rank = comm.global_rank()
    mesh = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("a", "b"))
    assert mesh.get_coordinate() == [rank % 2, rank // 2]
    assert _ranks(mesh.get_group("b")) == [rank % 2, rank % 2 + 2]
    if rank < 2:
        part = DeviceMesh("cpu", [0, 1])
        assert part.get_coordinate() == [rank] and _all_reduce_rank(part.get_group()) == 1
    else:
        part = DeviceMesh("cpu", [0, 1])
        assert part.get_coordinate() is None
        with pytest.raises(ValueError, match="is not in this mesh"):
            part.get_group()
    with pytest.raises(ValueError, match="not in increasing global-rank order"):
        DeviceMesh("cpu", [[1, 0], [3, 2]])
    g = mesh.get_group("a")
    from_group = DeviceMesh.from_group(g, "cpu", mesh_dim_names=("x",))
    assert from_group.get_group("x") is g and from_group.size() == 2


@distributed([1, 3])
def test_one_dim_mesh(world_size):
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    assert mesh.get_group() is comm.world_group() and mesh["dp"] is mesh
    assert mesh.get_local_rank() == comm.global_rank()
    assert repr(mesh) == f"DeviceMesh('cpu', {list(range(world_size))}, mesh_dim_names=('dp',))"


@distributed([4])
def test_unflatten_as_torchtitan_builds_its_meshes():
    """torchtitan's parallel_dims: one 1-D world mesh unflattened several times, names
    overlapping between the results; each is sliced and flattened by its own names. Ranks,
    coordinates and group members equal torch's _unflatten of the same world."""
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    ours = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    theirs = torch_mesh("cpu", (4,), mesh_dim_names=("world",))
    for sizes, names in [((2, 2), ("dp", "tp")), ((1, 2, 2), ("pp", "fsdp", "tp")), ((4,), ("batch",))]:
        a, b = ours._unflatten(0, sizes, names), theirs._unflatten(0, sizes, names)
        assert a.mesh.tolist() == b.mesh.tolist() and a.mesh_dim_names == b.mesh_dim_names == names
        assert a.get_coordinate() == list(b.get_coordinate())
        for name in names:
            assert _ranks(a.get_group(name)) == torch.distributed.get_process_group_ranks(b.get_group(name)), name
            assert a[name].mesh.tolist() == b[name].mesh.tolist(), name
    dense = ours._unflatten("world", (1, 2, 2), ("pp", "fsdp", "tp"), backend_override={"pp": "fake"})
    flat = dense["fsdp", "tp"]._flatten("fsdp_tp")
    assert flat.get_group() is comm.world_group() and dense["fsdp_tp"].get_group() is flat.get_group()
    assert dense["tp"].get_group() is ours._unflatten(0, (2, 2), ("dp", "tp"))["tp"].get_group(), "one group per rank set"
    two = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    split = two._unflatten("tp", (2, 1), ("tp", "x"))  # the other axes kept
    assert split.mesh.tolist() == [[[0], [1]], [[2], [3]]] and split.mesh_dim_names == ("dp", "tp", "x")
    assert split["dp"].get_group() is two.get_group("dp")
    with pytest.raises(ValueError, match=r"product of mesh_sizes=\(3, 2\) is 6.*size 4"):
        ours._unflatten(0, (3, 2), ("a", "b"))
    with pytest.raises(ValueError, match="'ep' specified in `_unflatten` is not in"):
        ours._unflatten("ep", (2, 2), ("a", "b"))
    with pytest.raises(RuntimeError, match="same length"):
        ours._unflatten(0, (2, 2), ("a",))
    with pytest.raises(ValueError, match="backend_override 'fake' for mesh axis 'tp' of 2 ranks"):
        ours._unflatten(0, (2, 2), ("dp", "tp"), backend_override={"tp": "fake"})
