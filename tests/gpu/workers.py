"""One NCCL parity check per strategy, run by `plait run --nproc-per-node W` (tests/gpu).

    python -m plait run --nproc-per-node W tests/gpu/workers.py NAME OUT.json
    ddp | fsdp | tp | pp: three SGD steps of a 3-layer MLP on cuda:LOCAL_RANK, the parallel run
        against a single-device reference computed on every rank (same seed, the whole batch);
        rank 0 writes the largest |difference| of the losses and of the final parameters
    train: `plait train`'s tiny config on the layout given after OUT.json (losses to OUT.json)

TF32 is off, so differences are float32 summation order only (sharded matmuls, reduce order).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch import nn

from plait import comm

STEPS, BATCH, DIM = 3, 8, 16


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Linear(4 * DIM, DIM), nn.ReLU(),
                         nn.Linear(DIM, DIM))


def _data(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, DIM, generator=g).to(device), torch.randn(BATCH, DIM, generator=g).to(device))
            for _ in range(STEPS)]


def _reference(device: torch.device) -> tuple[list[float], list[torch.Tensor]]:
    model = _mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _data(device):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()]


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _train(model: nn.Module, device: torch.device, shard_batch: bool) -> list[float]:
    rank, world = comm.global_rank(), comm.world_size()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _data(device):
        if shard_batch:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        if shard_batch:
            comm.all_reduce(t, group=comm.world_group(), op="avg")
        losses.append(t.item())
    return losses


def run(name: str, device: torch.device) -> tuple[list[float], list[torch.Tensor]]:
    from plait.device_mesh import init_device_mesh

    world = comm.world_size()
    mesh = init_device_mesh("cuda", (world,))
    model = _mlp().to(device)
    if name == "ddp":
        from plait.ddp import DistributedDataParallel

        ddp = DistributedDataParallel(model, process_group=mesh.get_group(0))
        return _train(ddp, device, True), [p.detach() for p in model.parameters()]
    if name == "fsdp":
        from plait.fsdp import fully_shard

        for layer in (model[0], model[2], model[4], model):
            fully_shard(layer, mesh=mesh)
        return _train(model, device, True), [_full(p) for p in model.parameters()]
    if name == "tp":
        from plait.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return _train(model, device, False), [_full(p) for p in model.parameters()]
    if name == "pp":
        return _pipeline(model, device)
    raise ValueError(f"unknown check {name!r}; choose ddp, fsdp, tp, pp or train")


def _pipeline(model: nn.Sequential, device: torch.device) -> tuple[list[float], list[torch.Tensor]]:
    from plait.pipelining import PipelineStage, Schedule1F1B

    rank, world = comm.global_rank(), comm.world_size()
    if world != 2:
        raise ValueError(f"the pipeline check runs 2 stages on 2 ranks, not {world}")
    parts = [model[:2], model[2:]]
    stage = PipelineStage(parts[rank], rank, world, device)
    schedule = Schedule1F1B(stage, 4, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(parts[rank].parameters(), lr=0.1)
    losses = []
    for x, y in _data(device):
        got: list = []
        schedule.step(*((x,) if rank == 0 else ()), target=y if rank == world - 1 else None, losses=got)
        opt.step()
        opt.zero_grad()
        # per-microbatch means summed by the schedule's loss_fn: the whole-batch mean is their mean
        t = torch.stack(got).mean() if got else torch.zeros((), device=device)
        comm.broadcast(t, src=world - 1, group=comm.world_group())
        losses.append(t.item())
    params = []
    for i, part in enumerate(parts):  # every stage's params to every rank, in model order
        for p in part.parameters():
            t = p.detach().clone() if i == rank else torch.empty_like(p)
            params.append(comm.broadcast(t, src=i, group=comm.world_group()))
    return losses, params


def main() -> None:
    name, out = sys.argv[1], sys.argv[2]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    comm.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    if name == "train":
        from plait.train import apply_overrides, load, train

        config = apply_overrides(load("tiny"), ["--metrics.progress", "false", *sys.argv[3:]])
        result = train(config)
        if comm.global_rank() == 0:
            json.dump({"losses": result.losses}, open(out, "w"))
    else:
        losses, params = run(name, device)
        ref_losses, ref_params = _reference(device)
        if comm.global_rank() == 0:
            json.dump({
                "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                "param_diff": max((a - b).abs().max().item() for a, b in zip(params, ref_params)),
                "steps": len(losses),
            }, open(out, "w"))
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
