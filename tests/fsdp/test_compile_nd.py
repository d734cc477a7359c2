"""torch.compile (backend aot_eager) of blocks under FSDP x TP, whose parameters carry
_StridedShard placements, and under reshard_after_forward=2 on 4 ranks: losses every step
equal to the same layout run eagerly, and graph breaks counted.

Each MegatronMLP block (tests/fsdp/test_hsdp_tp.py's Net: `up` ColwiseParallel with its 1-D
bias, `down` RowwiseParallel) is parallelized, compiled, then fully_shard-ed (torch's
order: compile per block before fully_shard); the eager twin is built the same way without
compile. fully_shard's hooks run outside the graph, so the graphs hold only the block's own
ops and the TP boundary conversions. Tolerance: losses rtol 1e-5 (aot_eager runs the same
aten ops, traced; measured bitwise equal over the 4 steps) and parameters after the steps atol 1e-5.
"""

import pytest
import torch
import torch.nn.functional as F

from plait.device_mesh import init_device_mesh
from plait.fsdp import fully_shard
from plait.tensor import _StridedShard
from plait.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from plait.testing import distributed
from tests.fsdp.common import make_opt
from tests.fsdp.test_hsdp_tp import Net

STEPS = 4


def _train(layout: str, compiled: bool):
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh, kwargs = mesh["dp"], {}
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        dp_mesh, kwargs = mesh, {"reshard_after_forward": 2}
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        if layout == "fsdp_tp":
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        if compiled:
            block.compile(backend="aot_eager")
        fully_shard(block, mesh=dp_mesh, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)
    if layout == "fsdp_tp":
        assert model.blocks[0].up.bias.placements[0] == _StridedShard(0, split_factor=2)
    dp_rank, per = dp_mesh.get_local_rank(), 8 // dp_mesh.size()
    opt = make_opt(model.parameters())
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(900 + step)
        x, y = torch.randn(8, 7, generator=g), torch.randint(5, (8,), generator=g)
        loss = F.cross_entropy(model(x[dp_rank * per:(dp_rank + 1) * per]), y[dp_rank * per:(dp_rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().full_tensor() for n, p in model.named_parameters()}


@distributed([4], timeout=400)
@pytest.mark.parametrize("layout", ["fsdp_tp", "reshard_after_forward_2"])
def test_compiled_blocks_train_like_eager(layout):
    import warnings

    import torch._dynamo

    eager_losses, eager_params = _train(layout, compiled=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, params = _train(layout, compiled=True)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=0)
    for fqn, value in eager_params.items():
        torch.testing.assert_close(params[fqn], value, atol=1e-5, rtol=1e-5, msg=lambda m, f=fqn: f"{f}: {m}")
    counters = torch._dynamo.utils.counters
    breaks, graphs = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    print(f"{layout}: graph breaks {breaks}, unique graphs {graphs}, losses {losses}")
    ours = [f"{w.filename}: {w.message}" for w in caught if "/plait/" in (w.filename or "")]
    assert not ours, ours
    assert breaks == {}, breaks
    assert graphs == 2, graphs  # one per block, none recompiled over the steps
