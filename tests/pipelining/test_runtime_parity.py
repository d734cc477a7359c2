"""Every schedule trains like one process: parity of losses, grads and AdamW parameters.

Each rank builds the same model from one seed, runs the single-process reference on the
whole batch itself (no communication needed to compare), then trains its own stages through
the pipeline for 3 steps and compares what it owns, by fqn.

Tolerances. The pipeline computes the same math in a different order (a mean loss per
microbatch, grads summed over microbatches and divided by 8, instead of one mean over the
batch), so only rounding differs. Observed worst over every schedule and world size: float32
transformer 4.8e-7 absolute (1.3e-5 relative) on losses, grads and params; float64 model
3.3e-15. Allowed: float32 rtol 1e-4 / atol 1e-5, float64 1e-9 / 1e-10 (about 20x and 3e4x
headroom). A real bug (a microbatch lost or counted twice, grads not scaled by 1/m, a W
skipped) moves grads of size 1e-2..1 by an eighth: 1e-3 or more. AdamW divides a grad by
its running RMS, which would turn the rounding noise of a grad that is ~0 in exact
arithmetic into a full lr-sized step; the float32 run's AdamW therefore uses eps=1e-3
(Adam's normalization kept for grads above ~1e-3, the update of a ~0 grad stays ~0).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLooped1F1B,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    SplitPoint,
    build_schedule,
    pipeline,
    split_evenly,
    split_model,
)
from plait.testing import distributed

MICROBATCHES = 8
STEPS = 3
LR = 1e-2

SCHEDULES = {
    "GPipe": (ScheduleGPipe, 1),
    "1F1B": (Schedule1F1B, 1),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2),
    "LoopedBFS": (ScheduleLoopedBFS, 2),
    "Looped1F1B": (ScheduleLooped1F1B, 2),  # plait's; 8 microbatches: a multiple of p
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, 2),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, 2),
    "DualPipeV": (ScheduleDualPipeV, 2),  # needs m >= 2p: 8 microbatches on up to 4 ranks
}


# --- a small transformer, split by layers ---------------------------------------------------


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos  # (B, T, D)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No qkv bias (as in Llama): a key bias cannot change a softmax row, its grad is 0.
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(
        self, vocab: int = 32, dim: int = 16, layers: int = 8, heads: int = 2, seq: int = 8
    ):
        super().__init__()
        self.embed = Embed(vocab, dim, seq)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))  # (B, T, vocab)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# --- stages of different size and width, a tuple crossing a boundary, float64 ----------------


class Dense(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Fork(nn.Module):
    """One input, two outputs of different widths (a tuple crosses the next boundary)."""

    def __init__(self, d_in: int, d_a: int, d_b: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d_in, d_a), nn.Linear(d_in, d_b)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.a(x)), self.b(x)


class Join(nn.Module):
    def __init__(self, d_a: int, d_b: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_a + d_b, d_out)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(torch.cat([a, b], dim=-1)))


class Uneven(nn.Module):
    """8 units from 6 to 96 features wide, parameter counts from 24 to 9312."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = Dense(6, 24)
        self.fork = Fork(24, 40, 3)
        self.join = Join(40, 3, 64)
        self.narrow = Dense(64, 8)
        self.wide = nn.ModuleList([Dense(8, 96), Dense(96, 96)])
        self.squeeze = Dense(96, 5)
        self.out = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.narrow(self.join(*self.fork(self.inp(x))))
        for layer in self.wide:
            h = layer(h)
        return self.out(self.squeeze(h))


UNEVEN_CUTS = {  # num_stages -> units that begin a stage (pipeline()'s split_spec)
    2: ["wide.0"],
    4: ["join", "wide.0", "squeeze"],
    8: ["fork", "join", "narrow", "wide.0", "wide.1", "squeeze", "out"],
}


# --- the parity check -----------------------------------------------------------------------


def _data(model_name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if model_name == "transformer":
        tokens = torch.randint(0, 32, (2 * MICROBATCHES, 8), generator=g)
        return tokens, torch.roll(tokens, -1, dims=1)
    x = torch.randn(2 * MICROBATCHES, 6, generator=g, dtype=torch.float64)
    return x, torch.randn(2 * MICROBATCHES, 4, generator=g, dtype=torch.float64)


def _model(model_name: str) -> tuple[nn.Module, callable, dict]:
    torch.manual_seed(0)
    if model_name == "transformer":
        return (
            TinyTransformer(),
            lm_loss,
            {"rtol": 1e-4, "atol": 1e-5, "params_atol": 1e-5, "eps": 1e-3},
        )
    return (
        Uneven().double(),
        F.mse_loss,
        {"rtol": 1e-9, "atol": 1e-10, "params_atol": 1e-10, "eps": 1e-8},
    )


_REFERENCES: dict[str, tuple] = {}  # per worker process: every test of a model reuses it


def _reference(model: nn.Module, loss_fn, model_name: str, eps: float):
    """Single process, whole batch: losses and grads per step, params at the end."""
    if model_name not in _REFERENCES:
        _REFERENCES[model_name] = _run_reference(model, loss_fn, model_name, eps)
    return _REFERENCES[model_name]


def _run_reference(model: nn.Module, loss_fn, model_name: str, eps: float):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
    losses, grads = [], []
    for step in range(STEPS):
        x, y = _data(model_name, step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _stage_modules(model: nn.Module, model_name: str, num_stages: int, owned: list[int]):
    """The transformer by hand (split_model), the uneven model through pipeline()."""
    if model_name == "transformer":
        return split_model(model, split_evenly(model, num_stages), owned)
    x, _ = _data(model_name, 0)
    spec = {fqn: SplitPoint.BEGINNING for fqn in UNEVEN_CUTS[num_stages]}
    pipe = pipeline(model, (x[:2],), split_spec=spec)
    assert pipe.num_stages == num_stages
    return [pipe.get_stage_module(s) for s in owned]


def _close(got, want, tol, what):
    torch.testing.assert_close(
        got, want, rtol=tol["rtol"], atol=tol["atol"], msg=lambda m: f"{what}: {m}"
    )


def check_parity(schedule_name: str, model_name: str, group=None, **schedule_options) -> None:
    group = group if group is not None else comm.world_group()
    rank, p = comm.get_rank(group), comm.get_world_size(group)
    cls, v = SCHEDULES[schedule_name]
    model, loss_fn, tol = _model(model_name)
    reference = _reference(copy.deepcopy(model), loss_fn, model_name, tol["eps"])
    num_stages = p * v
    per_rank = build_schedule(schedule_name, p, MICROBATCHES, stages_per_rank=v if v > 1 else None)
    owned = list(per_rank.stages_of(rank))
    modules = _stage_modules(model, model_name, num_stages, owned)
    stages = [PipelineStage(m, s, num_stages, "cpu", group=group) for m, s in zip(modules, owned)]
    schedule = cls(
        stages[0] if v == 1 else stages, MICROBATCHES, loss_fn=loss_fn, **schedule_options
    )
    train_and_compare(schedule, modules, owned, num_stages, model_name, tol, reference)


def train_and_compare(schedule, modules, owned, num_stages, model_name, tol, reference) -> None:
    """3 AdamW steps through `schedule`; losses and grads each step, params at the end."""
    ref_losses, ref_grads, ref_params = reference
    params = {n: p_ for m in modules for n, p_ in m.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=LR, eps=tol["eps"])
    first, last = 0 in owned, num_stages - 1 in owned
    for step in range(STEPS):
        x, y = _data(model_name, step)
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        out = schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        if last:
            assert len(losses) == schedule._n_microbatches
            _close(torch.stack(losses).mean(), ref_losses[step], tol, f"step {step} loss")
            assert out.shape[0] == x.shape[0]
        else:
            assert losses == [] and out is None
        for name, param in params.items():
            assert param.grad is not None, f"{name} got no grad"
            _close(param.grad, ref_grads[step][name], tol, f"step {step} grad of {name}")
        opt.step()
    for name, param in params.items():
        torch.testing.assert_close(
            param.detach(),
            ref_params[name].detach(),
            rtol=0,
            atol=tol["params_atol"],
            msg=lambda m, n=name: f"param {n}: {m}",
        )


@distributed([2, 4])
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_transformer_parity(schedule_name):
    check_parity(schedule_name, "transformer")


@distributed([2, 4])
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_uneven_stages_parity(schedule_name):
    check_parity(schedule_name, "uneven")


@distributed([2])
@pytest.mark.parametrize("rounds", [4, MICROBATCHES])
def test_looped_1f1b_with_larger_rounds_parity(rounds):
    """Rounds of 4 and of all 8 microbatches (breadth first, 1F1B steady state) on 2 ranks."""
    check_parity("Looped1F1B", "uneven", microbatches_per_round=rounds)


@distributed([4])
def test_pipelines_on_subgroups_address_peers_by_group_rank():
    """Two pipelines, on global ranks {0, 2} and {1, 3}: group rank 1 is global rank 2 or 3."""
    rank = comm.get_rank(comm.world_group())
    group = comm.new_group([rank % 2, rank % 2 + 2])
    check_parity("1F1B", "uneven", group=group)
    check_parity("ZBVZeroBubble", "uneven", group=group)
