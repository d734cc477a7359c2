"""HSDP over tensor parallel, and FSDP over TP on a root that is not 2-D: 8 ranks, a 3-D
(dp_replicate=2, dp_shard=2, tp=2) mesh, parity with one process.

The model's blocks are Megatron MLPs: `up` ColwiseParallel (its 1-D bias sharded by TP),
`down` RowwiseParallel; `inp` and `head` stay plain. fully_shard per block and the root on
mesh["dp_replicate", "dp_shard"] (HSDP: torch's placements (Replicate(), _StridedShard(0,
sf=2), Shard(0)) for `up`) or on the flattened mesh["dp_replicate", "dp_shard"] as one dp
axis of 4. Sizes are uneven: up's 10 and 14 rows are 5 and 7 per tp rank, cut by dp_shard
into 3+2 and 4+3. Each of the 4 dp ranks trains its quarter of the batch; the reference
trains the whole batch.

Tolerances as tests/fsdp/test_parity.py (float32): loss rtol 1e-5 every step, gathered
gradients atol 1e-6 / rtol 1e-4 every step, parameters after the steps atol 1e-5.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.device_mesh import init_device_mesh
from plait.fsdp import fully_shard
from plait.tensor import Replicate, Shard, _StridedShard
from plait.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from plait.testing import distributed
from tests.fsdp.common import assert_full_params_close, assert_grads_close, make_opt

STEPS = 4
BATCH = 8


class MegatronMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))  # (B, dim) -> (B, hidden/tp) -> (B, dim)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 6)
        self.blocks = nn.ModuleList([MegatronMLP(6, 10), MegatronMLP(6, 14)])
        self.head = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 7) -> (B, 5)
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, 7, generator=g), torch.randint(5, (BATCH,), generator=g)


@distributed([8], timeout=400)
@pytest.mark.parametrize("dp_axes", ["hsdp", "flattened"])
def test_hsdp_and_fsdp_over_tp_on_a_3d_mesh_train_like_one_process(dp_axes):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    torch.manual_seed(0)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    if dp_axes == "flattened":
        dp_mesh = dp_mesh.flatten("dp")
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    lead = (Replicate(),) if dp_axes == "hsdp" else ()
    strided = _StridedShard(0, split_factor=2)
    up, down = model.blocks[0].up, model.blocks[0].down
    assert up.weight.placements == up.bias.placements == (*lead, strided, Shard(0))
    assert down.weight.placements == (*lead, Shard(0), Shard(1))
    assert down.bias.placements == (*lead, Shard(0), Replicate())
    assert model.inp.weight.placements == (*lead, Shard(0))
    assert up.weight.device_mesh.ndim == len(lead) + 2
    assert_full_params_close(model, ref, atol=0, rtol=0, what="after sharding")

    coordinate = mesh.get_coordinate()
    dp_rank, per = coordinate[0] * 2 + coordinate[1], BATCH // 4
    dp_group = mesh["dp_replicate", "dp_shard"].flatten("dp").get_group()
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x[dp_rank * per:(dp_rank + 1) * per]), y[dp_rank * per:(dp_rank + 1) * per])
        loss.backward()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        assert_grads_close(model, ref, atol=1e-6, rtol=1e-4, what=f"step {step}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().reshape(1).clone()
        comm.all_reduce(mean, group=dp_group, op="avg")
        torch.testing.assert_close(mean.item(), ref_loss.item(), rtol=1e-5, atol=1e-6)
    assert_full_params_close(model, ref, atol=1e-5, rtol=1e-5, what=f"after {STEPS} steps")
