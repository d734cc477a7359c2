"""fully_shard on a model built on the meta device, then train, save a full checkpoint and
resume from it, in the flow of pytorch/examples distributed/FSDP2/example.py (+ its
checkpoint.py), written with plait's imports; the torch copy differs only in its import
lines (tests/examples/test_torch_examples.py writes it).

    plait run --standalone --nproc-per-node 2 fsdp2.py [--dcp-api] [--steps N]

The first launch loads a seeded full state dict (a pretrained model) into the meta model; a
launch that finds a checkpoint under ./checkpoints/<api>/<steps done> loads that instead:
with --dcp-api by set_model_state_dict / set_optimizer_state_dict of the full state dicts,
broadcast from rank 0; without, by distribute_tensor of each full tensor and
model.load_state_dict(sharded, assign=True), then the optimizer's state the same way. Each
launch trains --steps steps (batch drawn from the global step's seed, so two launches of N
steps equal one of 2N), prints the loss of each and saves the full state dicts from rank 0.
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from plait.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from plait.fsdp import FSDPModule, fully_shard
from plait.models.llama import CONFIGS, Transformer
from plait.tensor import DTensor, Shard, distribute_tensor

parser = argparse.ArgumentParser()
parser.add_argument("--dcp-api", action="store_true")
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()
folder = f"checkpoints/{'dcp_api' if args.dcp_api else 'dtensor_api'}"
done = max((int(n) for n in os.listdir(folder) if n.isdigit()), default=None) if os.path.isdir(folder) else None

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
with torch.device("meta"):
    model = Transformer(CONFIGS["tiny"])
for layer in model.layers.values():
    fully_shard(layer)
fully_shard(model)
assert isinstance(model, FSDPModule)
assert all(p.placements == (Shard(0),) and p.is_meta for p in model.parameters())

if done is None:  # a pretrained model's full state dict: the same on every rank, from one seed
    pretrained = Transformer(CONFIGS["tiny"])
    pretrained.init_weights(seed=0)
    full_sd = pretrained.state_dict()
else:
    full_sd = torch.load(f"{folder}/{done}/model.pt", mmap=True, weights_only=True, map_location="cpu")
if args.dcp_api:
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
else:
    meta_sd = model.state_dict()
    sharded = {k: nn.Parameter(distribute_tensor(v, meta_sd[k].device_mesh, meta_sd[k].placements))
               for k, v in full_sd.items()}
    model.load_state_dict(sharded, strict=False, assign=True)
model.rope_cache = model._rope(torch.device("cpu"))  # the non-persistent buffer, still on meta
assert not any(p.is_meta for p in model.parameters())

optim = torch.optim.Adam(model.parameters(), lr=1e-2)
if done is not None:
    full_osd = torch.load(f"{folder}/{done}/optim.pt", mmap=True, weights_only=True, map_location="cpu")
    if args.dcp_api:
        set_optimizer_state_dict(model, optim, full_osd,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        for p in model.parameters():  # create the state, then overwrite it with the checkpoint's
            p.grad = torch.zeros_like(p)
        optim.step()
        optim.zero_grad()
        osd = optim.state_dict()
        for pid, state in osd["state"].items():
            for key, value in full_osd["state"][pid].items():
                state[key] = (distribute_tensor(value, state[key].device_mesh, state[key].placements)
                              if isinstance(state[key], DTensor) else value)
        osd["param_groups"] = full_osd["param_groups"]
        optim.load_state_dict(osd)

start = done or 0
for step in range(start, start + args.steps):
    torch.manual_seed(step)
    x = torch.randint(0, CONFIGS["tiny"].vocab_size, (4, 16))
    loss = model(x).sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    optim.step()
    optim.zero_grad()
    print(f"rank {rank} step {step} loss {loss.item():.9e}", flush=True)

if args.dcp_api:
    model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    optim_sd = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
else:
    model_sd = {k: v.full_tensor() for k, v in model.state_dict().items()}
    osd = optim.state_dict()
    optim_sd = {"param_groups": osd["param_groups"],
                "state": {pid: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in s.items()}
                          for pid, s in osd["state"].items()}}
if rank == 0:
    os.makedirs(f"{folder}/{start + args.steps}", exist_ok=True)
    torch.save(model_sd, f"{folder}/{start + args.steps}/model.pt")
    torch.save(optim_sd, f"{folder}/{start + args.steps}/optim.pt")
dist.destroy_process_group()
gc.freeze()  # the exit's last GC would walk torch's ~300k objects, 0.8 CPU s per rank; nothing here needs it
