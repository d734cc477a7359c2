"""Models, data and the parity loop the DDP tests share (run on every rank).

Parity protocol, step t: a global batch from seed t, the same on every rank; rank r trains
its DDP replica on slice r; every rank also trains a single-process reference locally on
the whole batch. Models without BatchNorm: the reference's loss is the loss of the
concatenated batch (the mean over equal slices equals the mean of the slices' means).
BatchNorm normalizes per rank under DDP (no SyncBatchNorm), so its reference runs each
slice separately and averages the losses, and only slice 0's forward may move the running
statistics: DDP broadcasts rank 0's buffers before every forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.models import GPT, GPTConfig, lm_loss
from plait import comm

PER_RANK = 3  # samples per rank and step: odd, so no slice is a power of two


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 12)
        self.fc3 = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, bias=False)  # a bias before BatchNorm has gradient 0: AdamW would amplify noise
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 2, 5, 5)
        h = F.relu(self.bn(self.conv(x)))  # (B, 4, 3, 3)
        return self.head(h.mean(dim=(2, 3)))


class Branchy(nn.Module):
    """`aux` is used only when the caller says so: unused on some iterations or ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.aux = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_aux: bool = True) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if use_aux:
            h = h + torch.tanh(self.aux(h))
        return self.head(h)


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP()
    if kind == "cnn_bn":
        return ConvBN()
    if kind == "branchy":
        return Branchy()
    if kind == "gpt":
        return GPT(GPTConfig.tiny())
    raise ValueError(kind)


def batch(kind: str, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `n` samples for `step` (inputs, targets)."""
    gen = torch.Generator().manual_seed(1000 + step)
    if kind == "gpt":
        cfg = GPTConfig.tiny()
        tokens = torch.randint(cfg.vocab_size, (n, cfg.seq_len), generator=gen)
        return tokens, tokens
    shape = (n, 2, 5, 5) if kind == "cnn_bn" else (n, 6)
    return torch.randn(shape, generator=gen), torch.randint(3, (n,), generator=gen)


def loss_fn(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return lm_loss(out, target) if kind == "gpt" else F.cross_entropy(out, target)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def world() -> tuple[object, int, int]:
    g = comm.world_group()
    return g, comm.get_rank(g), comm.get_world_size(g)


def mine(t: torch.Tensor, rank: int, per: int = PER_RANK) -> torch.Tensor:
    return t[rank * per:(rank + 1) * per]


def reference_loss(kind: str, ref: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    """The single-process loss whose gradient DDP's averaged gradient must equal."""
    if kind != "cnn_bn":
        return loss_fn(kind, ref(x), y)
    real = {(mod, name): b for mod in ref.modules() for name, b in mod._buffers.items() if b is not None}
    losses = []
    for r in range(1, n):  # throw-away buffers: only slice 0 moves the running stats
        for (mod, name), b in real.items():
            mod._buffers[name] = b.clone()
        losses.append(loss_fn(kind, ref(mine(x, r)), mine(y, r)))
    for (mod, name), b in real.items():
        mod._buffers[name] = b
    losses.insert(0, loss_fn(kind, ref(mine(x, 0)), mine(y, 0)))
    return torch.stack(losses).mean()


def global_mean(value: torch.Tensor, group) -> float:
    t = value.detach().reshape(1).clone()
    comm.all_reduce(t, group=group, op="avg")
    return t.item()


def assert_params_close(model: nn.Module, ref: nn.Module, *, atol: float, rtol: float, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{what}: parameter {name}: {m}")


class TwoHeads(nn.Module):
    """Returns (main, side): a loss that leaves `side` out gives `side_head` no gradient
    although it is reachable from the outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 8)
        self.main_head = nn.Linear(8, 3)
        self.side_head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.main_head(h), self.side_head(h)


class SharedCheckpointed(nn.Module):
    """One layer applied in two reentrant-checkpointed segments (its gradient arrives
    twice per backward) plus a parameter no forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.never_used = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return self.head(h)


class Mixed(nn.Module):
    """fc2 in bfloat16 between float32 layers: one bucket dtype each, bf16 on the wire."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 12).to(torch.bfloat16)
        self.fc3 = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        return self.fc3(torch.tanh(self.fc2(h.bfloat16())).float())
