"""torch's DTensor debugging and placement names under plait.tensor: visualize_sharding
prints torch's table (checked against the text torch printed for the same layouts, and
live against torch's own when `tabulate`, which torch's needs, is installed), and
CommDebugMode counts under torch's keys what torch's counts for the same redistributions.
"""

import contextlib
import importlib.util
import io

import pytest
import torch

from plait.testing import distributed

HAVE_TABULATE = importlib.util.find_spec("tabulate") is not None

# what torch 2.13's visualize_sharding printed (rank 0) for these layouts
EXPECTED = {
    ("1d", (8, 4), "S0"): """\
         Col 0-3
-------  ---------
Row 0-3  cpu:0
Row 4-7  cpu:1""",
    ("1d", (5,), "S0"): """\
         Col 0-0
-------  ---------
Row 0-2  cpu:0
Row 3-4  cpu:1""",
    ("1d", (8, 4), "R"): """\
         Col 0-3
-------  ---------
Row 0-7  cpu:0,1""",
    ("2d", (8, 4), "S0S1"): """\
         Col 0-1    Col 2-3
-------  ---------  ---------
Row 0-3  cpu:0      cpu:1
Row 4-7  cpu:2      cpu:3""",
    ("2d", (5, 3), "S0S1"): """\
         Col 0-1    Col 2-2
-------  ---------  ---------
Row 0-2  cpu:0      cpu:1
Row 3-4  cpu:2      cpu:3""",
    ("2d", (8, 4), "RS0"): """\
         Col 0-3
-------  ---------
Row 0-3  cpu:0,2
Row 4-7  cpu:1,3""",
}


def _placements(code: str, lib):
    out, i = [], 0
    while i < len(code):
        if code[i] == "S":
            out.append(lib.Shard(int(code[i + 1])))
            i += 2
        else:
            out.append(lib.Replicate())
            i += 1
    return out


def _printed(fn, *args, **kwargs) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args, **kwargs)
    return buf.getvalue().rstrip("\n")


def _check_layouts(kind: str, mesh_shape: tuple[int, ...]):
    import torch.distributed.device_mesh as torch_mesh
    import torch.distributed.tensor as torch_dt
    from torch.distributed.tensor.debug import visualize_sharding as theirs

    import plait.device_mesh as plait_mesh
    import plait.tensor as plait_dt
    from plait.tensor.debug import visualize_sharding

    ours_mesh = plait_mesh.init_device_mesh("cpu", mesh_shape)
    their_mesh = torch_mesh.init_device_mesh("cpu", mesh_shape)
    rank = torch.distributed.get_rank()
    for (k, shape, code), expected in EXPECTED.items():
        if k != kind:
            continue
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        x = plait_dt.distribute_tensor(full, ours_mesh, _placements(code, plait_dt))
        printed = _printed(visualize_sharding, x, header="x")
        assert printed == (expected if rank == 0 else ""), (shape, code, printed)
        if HAVE_TABULATE:
            y = torch_dt.distribute_tensor(full, their_mesh, _placements(code, torch_dt))
            assert printed == _printed(theirs, y, header="x"), (shape, code)


@distributed([2])
def test_visualize_sharding_1d_mesh_as_torch():
    _check_layouts("1d", (2,))


@distributed([4])
def test_visualize_sharding_2d_mesh_as_torch():
    _check_layouts("2d", (2, 2))


def test_sharding_table_lists_ranks_sharing_a_piece():
    from plait.tensor.debug.visualize import sharding_table

    # the table alone (no process): ranks sharing a piece are listed in one cell
    assert sharding_table([((0, 1), (0, 0), 0), ((0, 1), (0, 0), 1)], device_kind="cpu").splitlines()[-1] \
        == "Row 0-1  cpu:0,1"


@distributed([2])
def test_visualize_sharding_errors_and_silence():
    import plait.device_mesh as plait_mesh
    from plait.tensor import Shard, distribute_tensor
    from plait.tensor.debug import visualize_sharding

    mesh = plait_mesh.init_device_mesh("cpu", (2,))
    with pytest.raises(RuntimeError, match="only 1D or 2D"):
        visualize_sharding(distribute_tensor(torch.zeros(2, 2, 2), mesh, [Shard(0)]))
    assert _printed(visualize_sharding, distribute_tensor(torch.zeros(0, 3), mesh, [Shard(0)])) == ""


@distributed([2])
def test_comm_debug_mode_counts_under_torchs_keys_as_torch():
    import torch.distributed.device_mesh as torch_mesh
    import torch.distributed.tensor as torch_dt
    from torch.distributed.tensor.debug import CommDebugMode as TheirMode

    import plait.device_mesh as plait_mesh
    import plait.tensor as plait_dt
    from plait.debug import CommDebugMode as PlaitMode
    from plait.tensor.debug import CommDebugMode

    assert CommDebugMode is PlaitMode
    funcol = torch.ops.c10d_functional
    keys = [funcol.all_gather_into_tensor, funcol.all_reduce, funcol.reduce_scatter_tensor]
    counts = []
    for lib, mesh_lib, mode_cls in ((plait_dt, plait_mesh, CommDebugMode), (torch_dt, torch_mesh, TheirMode)):
        mesh = mesh_lib.init_device_mesh("cpu", (2,))
        full = torch.arange(24.0).reshape(4, 6)
        x = lib.distribute_tensor(full, mesh, [lib.Shard(0)])
        p = lib.DTensor.from_local(full / 2, mesh, [lib.Partial()])
        with mode_cls() as mode:
            x.redistribute(mesh, [lib.Replicate()])  # all-gather
            p.redistribute(mesh, [lib.Replicate()])  # all-reduce
            p.redistribute(mesh, [lib.Shard(0)])  # reduce-scatter
        counts.append(([mode.get_comm_counts()[k] for k in keys], mode.get_total_counts()))
        with mode:  # a new block counts afresh (torch's __enter__ clears)
            pass
        assert mode.get_total_counts() == 0
    assert counts[0] == counts[1] == ([1, 1, 1], 3), counts
    # Shard(0) -> Shard(1): plait sends an all-to-all (torch all-gathers on Gloo); either
    # key names it, torch's native packet and its c10d op as well
    x = plait_dt.distribute_tensor(full, plait_mesh.init_device_mesh("cpu", (2,)), [plait_dt.Shard(0)])
    with CommDebugMode() as mode:
        x.redistribute(placements=[plait_dt.Shard(1)])
    counted = mode.get_comm_counts()
    assert counted["all_to_all"] >= 1 and counted["all_to_all"] == counted[funcol.all_to_all_single] \
        == counted[torch.ops._c10d_functional.all_to_all_single.default] \
        == counted.get(torch.ops.c10d.alltoall_base_) == mode.get_total_counts(), counted


def test_placement_types_module_names():
    import plait.tensor as plait_dt
    from plait.tensor import placement_types

    for name in ("Placement", "Shard", "Replicate", "Partial"):
        assert getattr(placement_types, name) is getattr(plait_dt, name)
