"""pytorch/tutorials recipes_source/zero_redundancy_optimizer.rst, on CPU with Gloo.

The recipe's script with the changes CPU needs, and nothing else: no `.to(rank)` or
`device_ids` (there is no GPU), 200-wide layers instead of 2000 (20 layers of 2000x2000 are
1.3 GB per rank with Adam: too much for the test machine), and, as CPU has no
`torch.cuda.max_memory_allocated`, "memory" counts the bytes the parameters, their gradients
and the optimizer's state hold on this rank, which is what ZeRO changes. Rank 0 prints, as in
the recipe. recipe_zero_torch.py imports torch's ZeRO and DDP, recipe_zero_plait.py plait's
(the porting rule applied to its import lines); test_zero.py checks that nothing else differs.
"""
# ruff: noqa: I001 - the recipe's import order, so that a port changes the import lines only

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP


def tensor_bytes(model, optimizer):
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    local = getattr(optimizer, "optim", optimizer)  # ZeRO holds its shard's state in a local optimizer
    tensors += [v for s in (local.state.values() if local else []) for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def print_peak_memory(prefix, device, model, optimizer=None):
    if device == 0:
        print(f"{prefix}: {tensor_bytes(model, optimizer) / 1e6}MB ")


def example(rank, world_size, use_zero):
    torch.manual_seed(0)
    if not dist.is_initialized():  # a test's worker pool has the group already
        os.environ["MASTER_ADDR"] = "localhost"
        os.environ["MASTER_PORT"] = "29500"
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    # create local model
    model = nn.Sequential(*[nn.Linear(200, 200) for _ in range(20)])
    print_peak_memory("Max memory allocated after creating local model", rank, model)

    # construct DDP model
    ddp_model = DDP(model)
    print_peak_memory("Max memory allocated after creating DDP", rank, model)

    # define loss function and optimizer
    loss_fn = nn.MSELoss()
    if use_zero:
        optimizer = ZeroRedundancyOptimizer(
            ddp_model.parameters(),
            optimizer_class=torch.optim.Adam,
            lr=0.01
        )
    else:
        optimizer = torch.optim.Adam(ddp_model.parameters(), lr=0.01)

    # forward pass
    outputs = ddp_model(torch.randn(20, 200))
    labels = torch.randn(20, 200)
    # backward pass
    loss_fn(outputs, labels).backward()

    # update parameters
    print_peak_memory("Max memory allocated before optimizer step()", rank, model, optimizer)
    optimizer.step()
    print_peak_memory("Max memory allocated after optimizer step()", rank, model, optimizer)

    print(f"params sum is: {sum(model.parameters()).sum()}")


def main():
    world_size = 2
    print("=== Using ZeroRedundancyOptimizer ===")
    mp.spawn(example, args=(world_size, True), nprocs=world_size, join=True)

    print("=== Not Using ZeroRedundancyOptimizer ===")
    mp.spawn(example, args=(world_size, False), nprocs=world_size, join=True)


if __name__ == "__main__":
    main()
