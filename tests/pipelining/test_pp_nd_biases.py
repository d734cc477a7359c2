"""Pipeline stages over FSDP x TP and over HSDP, 8 ranks, a model with TP-sharded 1-D biases:
4 steps like one process.

The model is tests/fsdp/test_hsdp_tp.py's Net cut in two stages: stage 0 `inp` + block 0,
stage 1 block 1 + `head`. Each block is a Megatron MLP whose `up` is ColwiseParallel (its 1-D
bias TP-sharded; uneven: 10 and 14 rows) and `down` RowwiseParallel (its bias replicated over
tp). Layouts, on one 3-D root, its slices used as they come (no mesh built per stage):
  - FSDP x TP x PP, (pp=2, dp=2, tp=2): TP on mesh["tp"], fully_shard on mesh["dp"] (placements
    (_StridedShard(0, sf=2), Shard(0)) for `up`'s weight and bias), PipelineStage on mesh["pp"].
  - HSDP x PP, (pp=2, dp_replicate=2, dp_shard=2): fully_shard on mesh["dp_replicate", "dp_shard"].
1F1B with 2 microbatches per dp rank; every dp rank feeds its share of the global batch of 16.
The reference: one process, the whole batch, the same AdamW.

Checked every step: the dp-mean of the pipeline's loss (rtol 1e-5) and every gathered grad
(atol 1e-6 / rtol 1e-4), parameters after 4 steps (atol 1e-5 / rtol 1e-5); tests/fsdp's
float32 tolerances: the same terms summed per microbatch and then over dp ranks.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.device_mesh import init_device_mesh
from plait.fsdp import fully_shard
from plait.pipelining import PipelineStage, Schedule1F1B
from plait.tensor import Replicate, Shard, _StridedShard
from plait.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from plait.testing import distributed
from tests.fsdp.common import make_opt
from tests.fsdp.test_hsdp_tp import Net

STEPS = 4
BATCH = 16
MICROBATCHES = 2


def _batch(step: int):
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(BATCH, 7, generator=g), torch.randint(5, (BATCH,), generator=g)


class Stage0(nn.Module):
    def __init__(self, net: Net) -> None:
        super().__init__()
        self.inp, self.block = net.inp, net.blocks[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.tanh(self.inp(x)))


class Stage1(nn.Module):
    def __init__(self, net: Net) -> None:
        super().__init__()
        self.block, self.head = net.blocks[1], net.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(h))


def _reference(ref: Net):
    opt = make_opt(ref.parameters())
    losses, grads = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _ref_name(pp_rank: int, name: str) -> str:
    prefix, rest = name.split(".", 1)
    if prefix == "block":
        return f"blocks.{pp_rank}.{rest}"
    return name


@distributed([8], timeout=400)
@pytest.mark.parametrize("layout", ["fsdp_tp_pp", "hsdp_pp"])
def test_pipeline_over_fsdp_x_tp_and_over_hsdp_trains_like_one_process(layout):
    if layout == "fsdp_tp_pp":
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        dp_mesh, dp_group = mesh["dp"], mesh["dp"].get_group()
    else:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        dp_group = mesh["dp_replicate", "dp_shard"].flatten("dp").get_group()
    pp_group = mesh["pp"].get_group()
    pp_rank, dp_rank, dp_size = comm.get_rank(pp_group), comm.get_rank(dp_group), comm.get_world_size(dp_group)
    torch.manual_seed(0)
    net = Net()
    ref_losses, ref_grads, ref_params = _reference(copy.deepcopy(net))
    module = (Stage0 if pp_rank == 0 else Stage1)(net)
    if layout == "fsdp_tp_pp":
        parallelize_module(module.block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(module.block, mesh=dp_mesh)
    fully_shard(module, mesh=dp_mesh)
    up = module.block.up
    if layout == "fsdp_tp_pp":
        assert up.weight.placements == up.bias.placements == (_StridedShard(0, split_factor=2), Shard(0))
        assert module.block.down.bias.placements == (Shard(0), Replicate())
    else:
        assert up.weight.placements == up.bias.placements == (Replicate(), Shard(0))
    schedule = Schedule1F1B(PipelineStage(module, pp_rank, 2, "cpu", group=pp_group), MICROBATCHES,
                            loss_fn=F.cross_entropy)
    params = dict(module.named_parameters())
    opt = make_opt(params.values())
    per = BATCH // dp_size
    for step in range(STEPS):
        x, y = _batch(step)
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        losses: list[torch.Tensor] = []
        schedule.step(*((x,) if pp_rank == 0 else ()), target=y if pp_rank == 1 else None, losses=losses)
        if pp_rank == 1:
            mean = torch.stack(losses).mean().reshape(1)
            comm.all_reduce(mean, group=dp_group, op="avg")
            torch.testing.assert_close(mean.item(), ref_losses[step], rtol=1e-5, atol=1e-6)
        for name, p in params.items():
            torch.testing.assert_close(p.grad.full_tensor(), ref_grads[step][_ref_name(pp_rank, name)],
                                       atol=1e-6, rtol=1e-4, msg=lambda m, n=name, s=step: f"step {s} grad of {n}: {m}")
        opt.step()
        opt.zero_grad()
    for name, p in params.items():
        torch.testing.assert_close(p.detach().full_tensor(), ref_params[_ref_name(pp_rank, name)],
                                   atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
