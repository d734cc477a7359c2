"""The zero-bubble split of backward: I (input grads) then W (weight grads) equals one full B.

No processes: each case runs a module twice from the same weights, once with one full
backward and once with I then W, and compares input grads and param grads. The cases are
the graphs that make the split hard: a linear used twice (a shared weight whose start
points chain through the input path), an output computed from parameters alone, an unused
input and an unused parameter, identity, a first stage whose input needs no grad.
Float64, so agreement is to rounding (1e-12).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from plait.pipelining.backward import backward_input, backward_weight, full_backward

F64 = torch.float64


class Twice(nn.Module):
    """`l` applied before and after `m`: l's start points lie on one chain through C."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.m = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.l(torch.tanh(self.m(self.l(x))))


class ParamOnlyOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.l = nn.Parameter(torch.randn(4)), nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x) + self.w * 2, self.w.exp() * 3  # second output: params only


class ParamAsOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.l = nn.Parameter(torch.randn(4)), nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x), self.w  # a leaf as an output: no grad_fn to start from


class UnusedBits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.l, self.unused = nn.Parameter(torch.randn(4)), nn.Linear(4, 4), nn.Linear(2, 2)

    def forward(self, x, y):  # y unused
        return self.l(x) * self.w.sin()


CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3)), [(5, 4)]),
    "transformer layer": (
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
        [(2, 3, 8)],
    ),
    "linear used twice": (Twice, [(5, 4)]),
    "output from params only": (ParamOnlyOutput, [(5, 4)]),
    "param returned as output": (ParamAsOutput, [(5, 4)]),
    "unused input and param": (UnusedBits, [(5, 4), (5, 4)]),
    "layernorm": (lambda: nn.LayerNorm(4), [(5, 4)]),
    "identity": (nn.Identity, [(5, 4)]),
}


def _twin(make):
    torch.manual_seed(0)
    a, b = make().to(F64), make().to(F64)
    b.load_state_dict(a.state_dict())
    return a, b


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("case", list(CASES))
def test_input_then_weight_equals_full_backward(case):
    make, shapes = CASES[case]
    full, split = _twin(make)
    xs = [torch.randn(s, dtype=F64) for s in shapes]
    x_full = [x.clone().requires_grad_() for x in xs]
    x_split = [x.clone().requires_grad_() for x in xs]
    out_full, out_split = _outputs(full(*x_full)), _outputs(split(*x_split))
    grads = [torch.randn_like(o) for o in out_full]

    want = full_backward(out_full, grads, x_full)
    got, state = backward_input(out_split, grads, x_split, list(split.parameters()))
    assert all(p.grad is None for p in split.parameters()), "I must not touch param grads"
    del out_split
    backward_weight(state)

    for k, (w, g) in enumerate(zip(want, got)):
        assert (w is None) == (g is None), f"input {k}"
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    for (name, p_full), p_split in zip(full.named_parameters(), split.parameters()):
        assert (p_full.grad is None) == (p_split.grad is None), name
        if p_full.grad is not None:
            torch.testing.assert_close(p_split.grad, p_full.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_grads_accumulate_over_microbatches():
    full, split = _twin(Twice)
    for _ in range(3):  # three microbatches
        x, ones = torch.randn(2, 4, dtype=F64), torch.ones(2, 4, dtype=F64)
        full_backward([full(x.clone().requires_grad_())], [ones], [])
        xs = x.clone().requires_grad_()
        _, state = backward_input([split(xs)], [ones], [xs], list(split.parameters()))
        backward_weight(state)
    for p_full, p_split in zip(full.parameters(), split.parameters()):
        torch.testing.assert_close(p_split.grad, p_full.grad, rtol=1e-12, atol=1e-12)


class _Tracer(torch.autograd.Function):
    """Identity; its backward logs `tag`, so a test sees which pass ran which part."""

    @staticmethod
    def forward(ctx, x, tag, log):
        ctx.tag, ctx.log = tag, log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.log.append(ctx.tag)
        return g, None, None


class Traced(nn.Module):
    def __init__(self, log):
        super().__init__()
        self.w, self.log = nn.Parameter(torch.randn(4)), log

    def forward(self, x):
        x = _Tracer.apply(x, "input path", self.log)
        return x * _Tracer.apply(self.w, "weight path", self.log)


def test_i_runs_only_the_input_path_and_w_only_the_weight_path():
    log: list[str] = []
    m = Traced(log)
    x = torch.randn(3, 4, requires_grad=True)
    _, state = backward_input([m(x)], [torch.ones(3, 4)], [x], [m.w])
    assert log == ["input path"]
    backward_weight(state)
    assert log == ["input path", "weight path"]


def test_first_stage_defers_the_whole_backward_to_w():
    """Inputs that need no grad (token ids): nothing needs I, so W does all of it."""
    log: list[str] = []
    m = Traced(log)
    x = torch.randn(3, 4)  # no grad
    got, state = backward_input([m(x)], [torch.ones(3, 4)], [x], [m.w])
    assert got == [None] and log == [] and m.w.grad is None
    backward_weight(state)
    assert log == ["weight path"]
    torch.testing.assert_close(m.w.grad, x.sum(0))


def test_graph_is_freed_after_w():
    """Between I and W the activations W needs stay alive; after W nothing does."""
    m = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(3, 4, requires_grad=True)
    hidden = m[1](m[0](x))  # saved by the second linear for its weight grad
    out = m[2](hidden)
    probe = weakref.ref(hidden)
    _, state = backward_input([out], [torch.ones(3, 4)], [x], list(m.parameters()))
    del out, hidden
    gc.collect()
    assert probe() is not None, "W needs the second linear's input: I must keep it"
    backward_weight(state)
    del state
    gc.collect()
    assert probe() is None, "after W the microbatch's activations must be released"
