"""FSDP over tensor parallel with torch's example's own plan and model shape
(pytorch/examples distributed/tensor_parallelism/fsdp_tp_example.py with its llama2_model:
complex rotary embeddings, `freqs_cis` a Replicate DTensor through PrepareModuleInput,
wq/wk/wv kept as DTensors into attention). Written with plait's imports; the torch copy
differs only in its import lines (tests/examples/test_torch_examples.py writes it).

    plait run --standalone --nproc-per-node 4 fsdp_tp_rotary.py [--steps N]

Every rank builds the same model (seed 0). Prints, on rank 0, each parameter's gradient
after the first backward (its full tensor's sum and norm, float64), and on every rank the
output's sum per step.
"""

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist

from plait.device_mesh import init_device_mesh
from plait.fsdp import fully_shard
from plait.tensor import Replicate, Shard
from plait.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama2_rotary import ModelArgs, Transformer  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
dp_rank = dp_mesh.get_local_rank()

torch.manual_seed(0)
config = ModelArgs()
model = Transformer(config)

parallelize_module(model, tp_mesh, {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
})
for block in model.layers:
    parallelize_module(block, tp_mesh, {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), Replicate()),
                                        desired_input_layouts=(Replicate(), Replicate())),
        "attention.wq": ColwiseParallel(use_local_output=False),
        "attention.wk": ColwiseParallel(use_local_output=False),
        "attention.wv": ColwiseParallel(use_local_output=False),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    })
fully_shard(model, mesh=dp_mesh)

optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
for i in range(args.steps):
    torch.manual_seed(i + dp_rank)  # the same batch across a tp group, another per dp rank
    inp = torch.randint(config.vocab_size, (2, 16))
    output = model(inp)
    output.sum().backward()
    if i == 0:
        for fqn, p in model.named_parameters():
            g = p.grad.full_tensor().double()
            if rank == 0:
                print(f"grad {fqn} sum {g.sum().item():.12e} norm {g.norm().item():.12e}", flush=True)
    optimizer.step()
    optimizer.zero_grad()
    print(f"rank {rank} step {i} sum {output.detach().sum().item():.9e}", flush=True)
dist.destroy_process_group()
gc.freeze()
