"""Each differentiable collective against the math, in float64.

Every rank builds every rank's input x_k and loss weights w_r from a shared seed. The
distributed run computes y_r = op(x) on each rank and backpropagates its local loss
L_r = sum(w_r * y_r). The reference runs the same op as plain tensor algebra in one
process on all inputs, with the total loss L = sum_r L_r (or, for all_reduce, whose
output is replicated, L counted once), and autograd gives dL/dx_k. Both are float64 and
use the same additions, so the tolerance is float64 round-off (1e-12).
"""

import pytest
import torch

from plait import comm
from plait.testing import chunk_sizes, distributed

ATOL = 1e-12


def _data(n, shape_of, salt):
    gen = torch.Generator().manual_seed(salt)
    xs = [torch.randn(shape_of(k), generator=gen, dtype=torch.float64) for k in range(n)]
    return xs


def _check(op, n, rank, xs, ys_of, local):
    """`ys_of(xs)` -> every rank's output (reference); `local(x)` -> this rank's output."""
    leaves = [x.clone().requires_grad_() for x in xs]
    ref_ys = ys_of(leaves)
    gen = torch.Generator().manual_seed(99)
    ws = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in ref_ys]
    if op == "all_reduce":  # replicated output, consumed identically: one loss
        ws = [ws[0]] * n
        total = (ws[0] * ref_ys[0]).sum()
    else:
        total = sum((w * y).sum() for w, y in zip(ws, ref_ys))
    total.backward()
    x = xs[rank].clone().requires_grad_()
    y = local(x)
    torch.testing.assert_close(y, ref_ys[rank].detach(), atol=ATOL, rtol=0)
    (ws[rank] * y).sum().backward()
    expected = leaves[0 if op == "all_reduce_grad" else rank].grad  # a replicated x is one variable
    expected = torch.zeros_like(x) if expected is None else expected  # unused input: zero gradient
    torch.testing.assert_close(x.grad, expected, atol=ATOL, rtol=0, msg=f"{op} gradient")


@distributed([1, 2, 3, 4])
@pytest.mark.parametrize("op", ["all_reduce", "all_reduce_grad", "all_gather", "reduce_scatter",
                                "all_to_all", "broadcast"])
def test_gradient_matches_math(op):
    g = comm.world_group()
    n, rank = comm.get_world_size(g), comm.get_rank(g)
    A = comm.autograd
    if op == "all_reduce":
        xs = _data(n, lambda k: (3, 2), 1)
        _check(op, n, rank, xs, lambda L: [sum(L)] * n, lambda x: A.all_reduce(x, group=g))
    elif op == "all_reduce_grad":
        xs = _data(1, lambda k: (3, 2), 2) * n  # replicated input
        _check(op, n, rank, xs, lambda L: [L[0]] * n, lambda x: A.all_reduce_grad(x, group=g))
    elif op == "all_gather":
        sizes = chunk_sizes(2 * n + 1, n)  # uneven
        xs = _data(n, lambda k: (2, sizes[k]), 3)
        _check(op, n, rank, xs, lambda L: [torch.cat(L, dim=1)] * n,
               lambda x: A.all_gather(x, group=g, dim=1, sizes=sizes))
    elif op == "reduce_scatter":
        sizes = chunk_sizes(2 * n + 1, n)
        xs = _data(n, lambda k: (2 * n + 1, 2), 4)
        _check(op, n, rank, xs, lambda L: list(torch.split(sum(L), sizes)),
               lambda x: A.reduce_scatter(x, group=g, sizes=sizes))
    elif op == "all_to_all":
        split = [[(i + j) % 3 + 1 for j in range(n)] for i in range(n)]  # split[src][dst]
        xs = _data(n, lambda k: (sum(split[k]), 2), 5)
        pieces = lambda L, src: torch.split(L[src], split[src])  # noqa: E731
        _check(op, n, rank, xs, lambda L: [torch.cat([pieces(L, s)[r] for s in range(n)]) for r in range(n)],
               lambda x: A.all_to_all(x, group=g, input_split_sizes=split[rank],
                                      output_split_sizes=[split[s][rank] for s in range(n)]))
    else:
        src = n - 1
        xs = _data(n, lambda k: (4,), 6)
        _check(op, n, rank, xs, lambda L: [L[src]] * n, lambda x: A.broadcast(x, src=src, group=g))
