"""The gradient intake's steady state (intake.py): once the buckets are rebuilt in ready
order, each countdown brings exactly the next bucket's gradients, and `_take_in` fills and
launches the bucket without `_fill`'s step per gradient. Whatever breaks that shape (an
order that changes, a gradient twice) goes through `_fill`, with the same results."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.ddp import DistributedDataParallel
from plait.testing import distributed
from tests.ddp.common import (
    PER_RANK,
    assert_params_close,
    batch,
    loss_fn,
    make_optimizer,
    mine,
    world,
)


class Swapped(nn.Module):
    """Two same-shaped layers applied in either order: the order gradients arrive in follows."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        first, second = (self.b, self.a) if swap else (self.a, self.b)
        return self.head(torch.tanh(second(torch.tanh(first(h)))))


class _FillCounter:
    """Counts the reducer's `_fill` calls (the per-gradient path)."""

    def __init__(self, reducer) -> None:
        self.calls = 0
        fill = reducer._fill

        def counted(*args, **kwargs):
            self.calls += 1
            return fill(*args, **kwargs)

        reducer._fill = counted


def _train(ddp, model, ref, swaps: list[bool], counter: _FillCounter) -> list[int]:
    """One step per entry of `swaps` on DDP and the single-process reference; `_fill` calls per step."""
    _, rank, n = world()
    opt, ref_opt = make_optimizer("adamw", ddp.parameters()), make_optimizer("adamw", ref.parameters())
    fills = []
    for step, swap in enumerate(swaps):
        x, y = batch("mlp", step, n * PER_RANK)
        before = counter.calls
        loss_fn("mlp", ddp(mine(x, rank), swap=swap), mine(y, rank)).backward()
        fills.append(counter.calls - before)
        loss_fn("mlp", ref(x, swap=swap), y).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_params_close(model, ref, atol=2e-5, rtol=1e-4, what="DDP against one process")
    return fills


def _models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = Swapped()
    torch.manual_seed(seed)
    return model, Swapped()


@distributed([2, 3])
@pytest.mark.parametrize("cap_mb", [25.0, 0.0003], ids=["one-bucket", "small-buckets"])
def test_steady_state_fills_whole_buckets_without_the_per_gradient_path(cap_mb):
    model, ref = _models()
    ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
    counter = _FillCounter(ddp.reducer)
    fills = _train(ddp, model, ref, [False] * 4, counter)
    assert ddp.reducer.has_rebuilt
    assert (len(ddp.reducer.buckets) >= 3) == (cap_mb < 1), len(ddp.reducer.buckets)
    assert fills[0] > 0, "the first iteration records the ready order through _fill"
    assert fills[2:] == [0, 0], f"_fill calls per step after the rebuild: {fills}"


@distributed([2, 3])
def test_an_order_that_changes_after_the_rebuild_goes_through_fill_and_trains_the_same():
    model, ref = _models()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0003)  # a bucket per layer or two
    counter = _FillCounter(ddp.reducer)
    swaps = [False, False, True, False, True, True, False]
    fills = _train(ddp, model, ref, swaps, counter)
    swapped = [f for f, s in zip(fills[2:], swaps[2:]) if s]
    assert all(f > 0 for f in swapped), f"_fill calls per step: {fills}"
    assert [f for f, s in zip(fills[2:], swaps[2:]) if not s] == [0, 0]


@distributed([2])
def test_a_gradient_twice_after_the_rebuild_still_names_the_parameter():
    from torch.utils.checkpoint import checkpoint

    class MaybeTwice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(6, 8)
            self.shared = nn.Linear(8, 8)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, twice: bool = False) -> torch.Tensor:
            h = torch.tanh(self.inp(x))
            for _ in range(2 if twice else 1):
                h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
            return self.head(h)

    ddp = DistributedDataParallel(MaybeTwice())
    for _ in range(3):
        ddp(torch.randn(2, 6)).sum().backward()
    assert ddp.reducer.has_rebuilt
    with pytest.raises(RuntimeError, match=r"shared\.(weight|bias) got its gradient twice"):
        ddp(torch.randn(2, 6), twice=True).sum().backward()
