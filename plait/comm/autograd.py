"""Differentiable collectives: each is an `autograd.Function` whose backward is the
collective that the forward's adjoint needs.

The gradient convention (Megatron's): the total loss is the sum of every rank's local
loss, and a result that is replicated across the group is consumed identically on every
rank. Under it:

    all_reduce       y = sum_k x_k (replicated)    dx_k = dy               (identity)
    all_reduce_grad  y_r = x (x replicated)        dx = sum_r dy_r         (all-reduce)
    all_gather       y = cat_k x_k                 dx_k = sum_r dy_r[k]    (reduce-scatter)
    reduce_scatter   y_r = sum_k x_k[r]            dx_k = cat_r dy_r       (all-gather)
    all_to_all       y_r = cat_k x_k[r]            dx_k = inverse all-to-all of dy
    broadcast        y_r = x_src                   dx_src = sum_r dy_r     (reduce to src)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from plait.comm import collectives as C
from plait.comm import gathers as G
from plait.comm.group import group_info


class _AllReduce(torch.autograd.Function):
    """All-reduce in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, op: str) -> torch.Tensor:
        return C.all_reduce(x.contiguous().clone(), group=group, op=op)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy, None, None


class _AllReduceGrad(torch.autograd.Function):
    """Identity in forward, all-reduce (sum) in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return C.all_reduce(dy.contiguous().clone(), group=ctx.group), None


class _AllGather(torch.autograd.Function):
    """All-gather in forward, reduce-scatter (sum) in backward."""

    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return G.all_gather(x, group=group, dim=dim, sizes=sizes)

    @staticmethod
    def backward(ctx, dy):
        return G.reduce_scatter(dy, group=ctx.group, dim=ctx.dim, sizes=ctx.sizes), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter (sum) in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return G.reduce_scatter(x, group=group, dim=dim, sizes=sizes)

    @staticmethod
    def backward(ctx, dy):
        return G.all_gather(dy, group=ctx.group, dim=ctx.dim, sizes=ctx.sizes), None, None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all in forward, all-to-all with the splits swapped in backward."""

    @staticmethod
    def forward(ctx, x, group, output_split_sizes, input_split_sizes):
        ctx.group, ctx.splits = group, (output_split_sizes, input_split_sizes)
        return G.all_to_all(x, group=group, output_split_sizes=output_split_sizes,
                            input_split_sizes=input_split_sizes)

    @staticmethod
    def backward(ctx, dy):
        out_splits, in_splits = ctx.splits
        dx = G.all_to_all(dy.contiguous(), group=ctx.group, output_split_sizes=in_splits,
                          input_split_sizes=out_splits)
        return dx, None, None, None


class _Broadcast(torch.autograd.Function):
    """Broadcast from src in forward, sum-reduce to src in backward (zero elsewhere)."""

    @staticmethod
    def forward(ctx, x, src, group):
        ctx.src, ctx.group = src, group
        return C.broadcast(x.contiguous().clone(), src=src, group=group)

    @staticmethod
    def backward(ctx, dy):
        dx = C.reduce(dy.contiguous().clone(), dst=ctx.src, group=ctx.group)
        if group_info(ctx.group).rank != ctx.src:
            dx = torch.zeros_like(dx)
        return dx, None, None


def all_reduce(x: torch.Tensor, *, group: ProcessGroup, op: str = "sum") -> torch.Tensor:
    """All-reduce in forward, identity in backward. Returns a new tensor."""
    return _AllReduce.apply(x, group, op)


def all_reduce_grad(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """Identity in forward, all-reduce (sum) in backward."""
    return _AllReduceGrad.apply(x, group)


def all_gather(x: torch.Tensor, *, group: ProcessGroup, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """All-gather along `dim` in forward, reduce-scatter (sum) in backward."""
    return _AllGather.apply(x, group, dim, None if sizes is None else list(sizes))


def reduce_scatter(x: torch.Tensor, *, group: ProcessGroup, dim: int = 0, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Reduce-scatter (sum) along `dim` in forward, all-gather in backward."""
    return _ReduceScatter.apply(x, group, dim, None if sizes is None else list(sizes))


def all_to_all(
    x: torch.Tensor,
    *,
    group: ProcessGroup,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """All-to-all along dim 0 in forward, all-to-all with the splits swapped in backward."""
    return _AllToAll.apply(
        x, group,
        None if output_split_sizes is None else list(output_split_sizes),
        None if input_split_sizes is None else list(input_split_sizes),
    )


def broadcast(x: torch.Tensor, *, src: int, group: ProcessGroup) -> torch.Tensor:
    """Broadcast from group rank `src` in forward, sum-reduce to `src` in backward."""
    return _Broadcast.apply(x, src, group)
