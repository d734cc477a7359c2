"""plait._functional_collectives: torch's funcol calls with plait's mesh as the group (under
the porting rule), equal to torch's funcol with torch's mesh; torch's funcol itself refuses
plait's mesh, which is why the twin exists."""

import pytest
import torch
import torch.distributed._functional_collectives as torch_funcol

from plait import _functional_collectives as funcol
from plait import comm
from plait.device_mesh import init_device_mesh
from plait.testing import distributed


@distributed([2])
def test_functional_collectives_take_plaits_mesh():
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    rank = comm.global_rank()
    ours, theirs = init_device_mesh("cpu", (2,)), torch_mesh("cpu", (2,))
    ours_2d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    x = torch.arange(6.0).view(2, 3) + 10 * rank  # (2, 3), another on each rank
    calls = [  # each on torch's funcol module or plait's, with a group of that library
        lambda f, g: f.all_reduce(x, "sum", g),
        lambda f, g: f.all_reduce(x, "max", g),
        lambda f, g: f.all_gather_tensor(x, 1, g),  # (2, 6)
        lambda f, g: f.reduce_scatter_tensor(x, "sum", 0, g),  # (1, 3)
        lambda f, g: f.all_to_all_single(x, None, None, g),
        lambda f, g: f.broadcast(x, 1, g),
    ]
    for i, call in enumerate(calls):
        want = torch_funcol.wait_tensor(call(torch_funcol, theirs))
        for group in (ours, (ours_2d, 1), (ours_2d, "tp")):
            got = funcol.wait_tensor(call(funcol, group))
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, i=i, g=group: f"call {i}, {g}: {m}")
    got = funcol.all_gather_tensor_autograd(x.clone().requires_grad_(), 0, ours)
    assert got.shape == (4, 3) and got.requires_grad
    with pytest.raises(AssertionError, match="Only 1D mesh is supported.*2-D"):
        funcol.all_reduce(x, "sum", ours_2d)
    with pytest.raises(ValueError, match="Unsupported group type"):
        torch_funcol.all_reduce(x, "sum", ours)
