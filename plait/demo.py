"""`plait demo`: a few steps of data-parallel training with gradients all-reduced by
plait.comm, checked against one process training on the whole batch.

    plait demo --nproc 4                         # starts 4 local ranks itself
    plait run --standalone --nproc-per-node 4 -m plait.demo   # or under a launcher

Each rank takes its slice of a global batch, runs forward and backward, and averages
gradients with one `comm.all_reduce` over a flat buffer. Rank 0 replays the same steps
on the whole batch in one process and prints both losses per step and the largest
parameter difference at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile

import torch
from torch import nn

from plait import comm

GLOBAL_BATCH = 32


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step % 2)  # two batches, alternating
    x = torch.randn(GLOBAL_BATCH, 16, generator=gen)
    return x, x.sin().sum(dim=1, keepdim=True)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    return loss.detach()


def train(steps: int) -> None:
    group = comm.world_group()
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    if GLOBAL_BATCH % world:
        raise ValueError(f"global batch {GLOBAL_BATCH} is not divisible by {world} ranks")
    per_rank = GLOBAL_BATCH // world
    model, reference = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    params = list(model.parameters())
    for step in range(steps):
        x, y = _batch(step)
        loss = _step(model, opt, x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # one collective for all grads
        comm.all_reduce(flat, group=group, op="avg")
        comm.all_reduce(loss, group=group, op="avg")
        torch.nn.utils.vector_to_parameters(flat, [p.grad for p in params])
        opt.step()
        if rank == 0:
            ref_loss = _step(reference, ref_opt, x, y)
            ref_opt.step()
            print(f"step {step}: loss {loss.item():.6f} on {world} ranks, {ref_loss.item():.6f} in one process")
    if rank == 0:
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
        print(f"max |parameter difference| after {steps} steps: {diff:.2e}")


def _worker(rank: int, world: int, store_path: str, steps: int) -> None:
    torch.set_num_threads(1)
    store = torch.distributed.FileStore(store_path, world)
    comm.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        train(steps)
    finally:
        comm.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plait demo", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4, help="ranks to start (ignored under a launcher)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # started by `plait run` or torchrun: this process is one rank
        comm.init_process_group()
        train(args.steps)
        comm.destroy_process_group()
        return 0
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="plait-demo-") as tmp:
        procs = [ctx.Process(target=_worker, args=(r, args.nproc, os.path.join(tmp, "store"), args.steps))
                 for r in range(args.nproc)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        print(f"plait demo: ranks {failed} failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
