"""One tiny model laid out every way plait trains it, and one training step per layout.

Model: inp Linear(7, 12) -> mid (tanh, Linear(12, 11), tanh, * buffer scale) -> out
Linear(11, 5); 12 divides by the tp degrees (TP's local outputs must be even), every other
dim by none of 2, 3, 4 (FSDP's dim-0 pieces are uneven; FSDP+TP's dp piece of a colwise TP
piece is torch's (_StridedShard(0, sf=tp), Shard(0))). `Tied` shares its embedding with its head.

Layouts (built on every rank of the world): single (one process's model, as is), ddp,
replicate, fsdp (per layer + root), hsdp (2 x world/2), tp (inp colwise, mid.lin rowwise),
fsdp_tp (dp=2 x tp=world/2), pp (split_model: rank r holds stage r of [[inp, mid], [out]]),
compile (torch.compile'd), ac (mid wrapped by checkpoint_wrapper), fsdp1
(FullyShardedDataParallel with mid, checkpoint-wrapped, as its own unit).

Step protocol: a global batch of 12 from the step's seed. Data-parallel layouts train rank
r's equal slice (their averaged grads are the whole batch's); tp and pp train the whole batch.
A single-process reference on the whole batch is then what every layout must equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.checkpoint.state_dict import StateDictOptions, get_state_dict
from plait.device_mesh import init_device_mesh
from plait.tensor import DTensor

BATCH = 12
FULL = StateDictOptions(full_state_dict=True)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 11)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 11))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(torch.tanh(x))) * self.scale  # (B, 12) -> (B, 11)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 12)  # colwise: FSDP+TP cuts its weight and 1-D bias strided
        self.mid = Scaled()
        self.out = nn.Linear(11, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 7) -> (B, 5)
        return self.out(self.mid(self.inp(x)))  # the chain of its units, so pp splits it as is


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 7) float -> (B, 5)
        ids = (x.abs() * 10).long().clamp(max=10)[:, 0]  # (B,)
        return self.head(torch.tanh(self.mid(self.emb(ids))))[:, :5]  # (B, 11) -> (B, 5)


def build(seed: int = 0, *, tied: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return Tied() if tied else Net()


def make_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 7, generator=g), torch.randn(BATCH, 5, generator=g)


def world() -> tuple[int, int]:
    if not comm.is_initialized():
        return 0, 1
    g = comm.world_group()
    return comm.get_rank(g), comm.get_world_size(g)


# layout -> (world sizes it runs on, whether each rank trains a slice)
LAYOUTS = {
    "single": ((1,), False), "ddp": ((2, 3), True), "replicate": ((2, 3), True),
    "fsdp": ((2, 3, 4), True), "hsdp": ((4,), True), "tp": ((2, 3), False), "fsdp_tp": ((4,), True),
    "pp": ((2,), False), "compile": ((1,), False), "ac": ((1, 2), False), "fsdp1": ((2, 3), True),
}


def lay_out(model: nn.Module, layout: str) -> nn.Module:
    from plait.ddp import DistributedDataParallel, replicate
    from plait.fsdp import fully_shard
    from plait.pipelining import split_model
    from plait.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    rank, n = world()
    tp_plan = {"inp": ColwiseParallel(), "mid.lin": RowwiseParallel()}
    if layout == "single":
        return model
    if layout == "ddp":
        return DistributedDataParallel(model)
    if layout == "replicate":
        return replicate(model)
    if layout in ("fsdp", "hsdp"):
        mesh = init_device_mesh("cpu", (2, n // 2)) if layout == "hsdp" else init_device_mesh("cpu", (n,))
        owners: dict[int, int] = {}  # tied weights stay in the root's group
        for child in model.children():
            for p in child.parameters():
                owners[id(p)] = owners.get(id(p), 0) + 1
        for child in model.children():
            params = list(child.parameters())
            if params and all(owners[id(p)] == 1 for p in params):
                fully_shard(child, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    if layout == "tp":
        return parallelize_module(model, init_device_mesh("cpu", (n,)), tp_plan)
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan)
        fully_shard(model.mid, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"])
    if layout == "pp":
        return split_model(model, [["inp", "mid"], ["out"]], rank)[0]
    if layout == "compile":
        return torch.compile(model)
    if layout == "ac":
        from plait.activation_checkpointing import checkpoint_wrapper
        model.mid = checkpoint_wrapper(model.mid)
        return model
    if layout == "fsdp1":  # FSDP1's wrapper, mid wrapped on its own, around activation checkpointing
        from plait.activation_checkpointing import checkpoint_wrapper
        from plait.fsdp import FullyShardedDataParallel
        from plait.fsdp.wrap import ModuleWrapPolicy
        model.mid = checkpoint_wrapper(model.mid)
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({type(model.mid)}))
    raise ValueError(layout)


def dp_slice(layout: str, t: torch.Tensor) -> torch.Tensor:
    """The rows of the global batch this rank trains on."""
    rank, n = world()
    if not LAYOUTS[layout][1]:
        return t
    if layout == "fsdp_tp" or layout == "hsdp":
        dp, dp_rank = (2, rank // (n // 2)) if layout == "fsdp_tp" else (n, rank)
    else:
        dp, dp_rank = n, rank
    per = BATCH // dp
    return t[dp_rank * per:(dp_rank + 1) * per]


def step(model: nn.Module, opt: torch.optim.Optimizer, layout: str, i: int) -> None:
    x, y = batch(i)
    if layout == "pp":  # two stages, one microbatch: activations forward, their grad back
        rank, _ = world()
        g = comm.world_group()
        if rank == 0:
            h = model(x)  # (B, 11)
            comm.send(h.detach().contiguous(), dst=1, group=g)
            grad = comm.recv(torch.empty_like(h), src=1, group=g)
            h.backward(grad)
        else:
            h = comm.recv(torch.empty(BATCH, 11), src=0, group=g).requires_grad_()
            F.mse_loss(model(h), y).backward()
            comm.send(h.grad.contiguous(), dst=0, group=g)
    else:
        # compile: the wrapped module runs eagerly (what the state dict sees is the wrapper's names;
        # compiling the graph would cost ~15 s on 2 cores and test the compiler, not the state)
        run = model._orig_mod if layout == "compile" else model
        F.mse_loss(run(dp_slice(layout, x)), dp_slice(layout, y)).backward()
    opt.step()
    opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    return get_state_dict(model, opt, options=FULL)


def plain(value):
    return value.full_tensor() if isinstance(value, DTensor) else value
