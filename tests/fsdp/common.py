"""Models, data and the parity loop the FSDP tests share (run on every rank).

Parity protocol, step t: a global batch from seed t, the same on every rank; rank r trains
its FSDP model on slice r of it; every rank also trains a single-process reference on the
whole batch. Both start from the same seed (FSDP, like torch's, shards what every rank
built; it broadcasts nothing). The mean of the ranks' losses over equal slices is the
reference's loss on the whole batch, and FSDP's averaged gradient is the reference's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.fsdp import fully_shard
from tests.ddp.common import PER_RANK, mine, world  # the same slicing as the DDP tests


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class MLP(nn.Module):
    """Dims 7, 13, 11, 5: none divides by 2, 3 or 4. `scale` is a buffer in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.blocks = nn.ModuleList([Block(13, 11), Block(11, 13)])
        self.head = nn.Linear(13, 5)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 13))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 7)
        h = self.inp(x) * self.scale  # (B, 13)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, 5)


class Tied(nn.Module):
    """Input embedding and output head share one weight (both in the root group)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList([Block(6, 6), Block(6, 6)])
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B,) token ids
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, 11)


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"mlp": MLP, "tied": Tied}[kind]()


def batch(kind: str, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    classes = 5 if kind == "mlp" else 11
    x = torch.randn(n, 7, generator=gen) if kind == "mlp" else torch.randint(11, (n,), generator=gen)
    return x, torch.randint(classes, (n,), generator=gen)


def shard(model: nn.Module, **kwargs) -> nn.Module:
    """fully_shard per block, then the root."""
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def global_mean(value: torch.Tensor, group) -> float:
    """The mean over ranks, in float32 (a bfloat16 loss is averaged without rounding)."""
    t = value.detach().reshape(1).clone().float()
    comm.all_reduce(t, group=group, op="avg")
    return t.item()


def make_opt(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def assert_full_params_close(model: nn.Module, ref: nn.Module, *, atol: float, rtol: float, what: str) -> None:
    """Every sharded parameter, gathered, equals the reference's (names must match too)."""
    ours = dict(model.named_parameters())
    theirs = dict(ref.named_parameters())
    assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    for name, p in ours.items():
        torch.testing.assert_close(whole(p).detach(), whole(theirs[name]).detach(), atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{what}: parameter {name}: {m}")


def assert_grads_close(model: nn.Module, ref: nn.Module, *, atol: float, rtol: float, what: str) -> None:
    """Every sharded .grad, gathered, equals the reference's (AdamW alone would not see a
    gradient scaled by a constant: its step is invariant to that)."""
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{what}: parameter {name} has no gradient"
        torch.testing.assert_close(p.grad.full_tensor(), theirs[name].grad, atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{what}: gradient of {name}: {m}")


def slices_to_reference(ref: nn.Module, low: nn.Module, slice_loss, n: int) -> float:
    """The mixed-precision reference's step (see test_policies.py): `slice_loss(r)` is the loss
    of `low` (a low-precision copy of `ref`) on rank r's slice; each slice's backward runs on
    its own, the slices' gradients are summed in float32 in rank order and divided by n into
    ref's .grad. Returns the mean of the slices' losses."""
    total = {name: torch.zeros_like(p) for name, p in ref.named_parameters()}
    losses = []
    for r in range(n):
        loss = slice_loss(r)
        loss.backward()
        for name, p in low.named_parameters():
            total[name] += p.grad.float()
            p.grad = None
        losses.append(loss.float())
    for name, p in ref.named_parameters():
        p.grad = total[name] / n
    return torch.stack(losses).mean().item()


def train_parity(kind: str, model: nn.Module, ref: nn.Module, *, steps: int, rtol: float = 1e-5,
                 loss_scale: float = 1.0, grad_atol: float = 1e-6) -> None:
    """Train `model` (already sharded) and `ref` side by side; losses must agree every step."""
    g, rank, n = world()
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(steps):
        x, y = batch(kind, step, n * PER_RANK)
        loss = F.cross_entropy(model(mine(x, rank)), mine(y, rank)) * loss_scale
        loss.backward()
        ref_loss = F.cross_entropy(ref(x), y) * loss_scale
        ref_loss.backward()
        assert_grads_close(model, ref, atol=grad_atol, rtol=1e-4, what=f"step {step}")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(global_mean(loss, g), ref_loss.item(), rtol=rtol, atol=1e-6,
                                   msg=lambda m, step=step: f"loss at step {step}: {m}")
