"""FSDP over tensor parallel on a (dp, tp) mesh, in the flow of pytorch/examples
distributed/tensor_parallelism/fsdp_tp_example.py, written with plait's imports; the torch
copy differs only in its import lines (tests/examples/test_torch_examples.py writes it).

    plait run --standalone --nproc-per-node 4 fsdp_tp.py [--steps N]

Every rank initializes the model from its own seed (the example's ranks initialize
independently), so what each rank keeps depends on the parameters' placements. Prints one
line per step: the output's sum, the number the test compares.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist

from plait.device_mesh import init_device_mesh
from plait.fsdp import fully_shard
from plait.models.llama import CONFIGS, Transformer
from plait.tensor import Replicate, Shard
from plait.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--tp", type=int, default=2)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
dp_rank = dp_mesh.get_local_rank()

torch.manual_seed(rank)
model = Transformer(CONFIGS["tiny"])
model.init_weights(seed=rank)

parallelize_module(model, tp_mesh, {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
})
for block in model.layers.values():
    parallelize_module(block, tp_mesh, {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    })
    fully_shard(block, mesh=dp_mesh)
fully_shard(model, mesh=dp_mesh)
if rank == 0:
    for fqn, p in model.named_parameters():
        print(f"placement {fqn} {tuple(p.placements)}", flush=True)

optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
for i in range(args.steps):
    torch.manual_seed(i + dp_rank)  # the same batch across a tp group, another per dp rank
    inp = torch.randint(CONFIGS["tiny"].vocab_size, (2, 16))
    output = model(inp)
    output.sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"rank {rank} step {i} sum {output.detach().sum().item():.9e}", flush=True)
dist.destroy_process_group()
gc.freeze()  # the exit's last GC would walk torch's ~300k objects, 0.8 CPU s per rank; nothing here needs it
