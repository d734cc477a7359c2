"""The collectives that change a tensor's shape: all-gather, reduce-scatter, all-to-all.

    tensor -> rows along `dim` (moved first, contiguous) -> native c10d op, or an
    all-reduce form (algorithms.py) -> rows back along `dim` -> result or `out=`

Gathers and scatters work along any `dim` and with uneven `sizes` per rank (every rank
passes the same list). Bytes are counted with the ring model: all-gather and
reduce-scatter send (N-1)/N·S per rank, where S is the full tensor's size; their
all-reduce forms 2(N-1)/N·S.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from plait.comm import _c10d, algorithms, checks
from plait.comm.collectives import _C10D_OPS, _begin, _end, _local, _nbytes
from plait.comm.eager import eager_only
from plait.comm.group import group_info


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of a contiguous tensor's bytes, for a bit-exact sum."""
    flat = t.view(-1).view(torch.uint8)
    aligned = flat.numel() % 4 == 0 and flat.storage_offset() % 4 == 0
    return flat.view(torch.int32) if aligned else flat


def _row_bytes(t: torch.Tensor, dim: int) -> int:
    return t.element_size() * math.prod(s for i, s in enumerate(t.shape) if i != dim)


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`t` with `dim` moved first, contiguous: the layout c10d gathers and scatters along."""
    return (t if dim == 0 else t.movedim(dim, 0)).contiguous()


def _unrows(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t if dim == 0 else t.movedim(0, dim).contiguous()


def _check_out(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype):
        raise ValueError(
            f"out= has shape {tuple(out.shape)} and dtype {out.dtype}; {what} needs shape {shape} "
            f"and dtype {dtype}"
        )


def _deliver(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None or out is result:
        return result if out is None else out
    return out.copy_(result)


def _offsets(sizes: Sequence[int]) -> list[int]:
    offsets, acc = [], 0
    for s in sizes:
        offsets.append(acc)
        acc += s
    return offsets


@eager_only
def all_gather(
    tensor: torch.Tensor,
    *,
    group: ProcessGroup,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Concatenate every rank's `tensor` along `dim`, in group-rank order.

    `sizes[r]` is rank r's size along `dim` when they differ (every rank passes the same
    list); the other dims must match. Returns a new tensor, or writes `out`.
    """
    info = group_info(group)
    checks.tensor(tensor, "tensor", info, in_place=False)
    dim = checks.dim(dim, tensor, "tensor")
    n, local_rows = info.size, tensor.size(dim)
    if sizes is None:
        sizes = [local_rows] * n
    else:
        sizes = checks.split_sizes(sizes, n, None, "sizes")
        if sizes[info.rank] != local_rows:
            raise ValueError(
                f"sizes[{info.rank}] = {sizes[info.rank]} but this rank's tensor has "
                f"{local_rows} along dim {dim} (shape {tuple(tensor.shape)})"
            )
    total = sum(sizes)
    out_shape = tuple(tensor.shape[:dim]) + (total,) + tuple(tensor.shape[dim + 1:])
    _check_out(out, out_shape, tensor.dtype, "this all_gather")
    row_bytes = _row_bytes(tensor, dim)
    full_bytes = total * row_bytes
    even = len(set(sizes)) == 1
    impl = algorithms.choose("all_gather", info.backend, full_bytes)
    if impl == "native" and not even and info.backend == "gloo":
        impl = "all_reduce"  # Gloo would need padding copies; the sum needs none
    if impl == "all_reduce":
        sent = 2 * (n - 1) / n * full_bytes
    else:
        sent = (n - 1) * max(sizes) * row_bytes
    event = _begin("all_gather", info, (tensor,), (out_shape,), (tensor.dtype,), sent, async_op, impl=impl)
    if n == 1:
        return _local(_deliver(tensor.clone(), out), event, async_op)

    x = _rows(tensor, dim)  # (rows, *rest)
    rest = tuple(x.shape[1:])
    into_out = out is not None and dim == 0 and out.is_contiguous()
    if impl == "all_reduce":
        buf = out.zero_() if into_out else x.new_zeros((total, *rest))
        offset = sum(sizes[: info.rank])
        buf.narrow(0, offset, local_rows).copy_(x)
        work = _c10d.all_reduce(_bits(buf), group=group, async_op=async_op)
        return _end(work, lambda: _deliver(_unrows(buf, dim), out), event, async_op)

    native = checks.is_native(tensor.dtype, info.backend)
    if even:
        buf = out if into_out else x.new_empty((total, *rest))
        send, recv = (x, buf) if native else (x.view(torch.uint8), buf.view(torch.uint8))
        work = _c10d.all_gather_single(recv, send, group=group, async_op=async_op)
        return _end(work, lambda: _deliver(_unrows(buf, dim), out), event, async_op)

    width = max(sizes)
    padded = x.new_zeros((width, *rest))
    padded.narrow(0, 0, local_rows).copy_(x)
    buf = x.new_empty((n * width, *rest))
    send, recv = (padded, buf) if native else (padded.view(torch.uint8), buf.view(torch.uint8))
    work = _c10d.all_gather_single(recv, send, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        pieces = [buf.narrow(0, r * width, s) for r, s in enumerate(sizes)]
        return _deliver(_unrows(torch.cat(pieces), dim), out)

    return _end(work, finish, event, async_op)


@eager_only
def reduce_scatter(
    tensor: torch.Tensor,
    *,
    group: ProcessGroup,
    op: str = "sum",
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce `tensor` across the group and give rank r its r-th piece along `dim`.

    Pieces are equal (the size along `dim` must divide by the group size) unless `sizes`
    gives each rank's piece. Returns a new tensor, or writes `out`; `tensor` is unchanged.
    """
    info = group_info(group)
    checks.tensor(tensor, "tensor", info, in_place=False)
    dim = checks.dim(dim, tensor, "tensor")
    op = checks.reduce_op(op, tensor.dtype, info.backend)
    n, rows = info.size, tensor.size(dim)
    if sizes is None:
        if rows % n:
            raise ValueError(
                f"reduce_scatter of shape {tuple(tensor.shape)} along dim {dim}: {rows} is not "
                f"divisible by the group size {n}; pass sizes= (e.g. torch.chunk's split)"
            )
        sizes = [rows // n] * n
    else:
        sizes = checks.split_sizes(sizes, n, rows, "sizes")
    mine, offset = sizes[info.rank], sum(sizes[: info.rank])
    out_shape = tuple(tensor.shape[:dim]) + (mine,) + tuple(tensor.shape[dim + 1:])
    _check_out(out, out_shape, tensor.dtype, "this reduce_scatter")
    full = _nbytes(tensor)
    even = len(set(sizes)) == 1
    impl = algorithms.choose("reduce_scatter", info.backend, full)
    width = max(sizes)  # uneven native pads every piece to the widest
    sent = 2 * (n - 1) / n * full if impl == "all_reduce" else (n - 1) * width * _row_bytes(tensor, dim)
    event = _begin("reduce_scatter", info, (tensor,), (out_shape,), (tensor.dtype,), sent, async_op,
                   reduce_op=op, impl=impl)
    if n == 1:
        return _local(_deliver(tensor.clone(), out), event, async_op)

    x = _rows(tensor, dim)
    rest = tuple(x.shape[1:])
    if impl == "all_reduce":
        buf = x.clone() if x.data_ptr() == tensor.data_ptr() else x
        work = _c10d.all_reduce(buf, op=_C10D_OPS[op], group=group, async_op=async_op)
        return _end(work, lambda: _deliver(_unrows(buf.narrow(0, offset, mine).clone(), dim), out),
                    event, async_op)

    if even:
        into_out = out is not None and dim == 0 and out.is_contiguous()
        buf = out if into_out else x.new_empty((mine, *rest))
        work = _c10d.reduce_scatter_single(buf, x, op=_C10D_OPS[op], group=group, async_op=async_op)
        return _end(work, lambda: _deliver(_unrows(buf, dim), out), event, async_op)

    padded = x.new_zeros((n * width, *rest))
    for r, (start, size) in enumerate(zip(_offsets(sizes), sizes)):
        padded.narrow(0, r * width, size).copy_(x.narrow(0, start, size))
    buf = x.new_empty((width, *rest))
    work = _c10d.reduce_scatter_single(buf, padded, op=_C10D_OPS[op], group=group, async_op=async_op)
    return _end(work, lambda: _deliver(_unrows(buf.narrow(0, 0, mine), dim), out), event, async_op)


@eager_only
def all_to_all(
    tensor: torch.Tensor,
    *,
    group: ProcessGroup,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
) -> Any:
    """Send rank r the r-th piece of `tensor` along dim 0; return the pieces received,
    concatenated in group-rank order. Pieces are equal unless both split lists are given."""
    info = group_info(group)
    checks.tensor(tensor, "tensor", info, in_place=False)
    n = info.size
    if tensor.dim() == 0:
        raise ValueError("all_to_all needs a tensor with at least one dim; reshape it to (1,)")
    rows = tensor.size(0)
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError("pass both output_split_sizes and input_split_sizes, or neither")
    if input_split_sizes is None:
        if rows % n:
            raise ValueError(
                f"all_to_all of {rows} rows on {n} ranks: {rows} is not divisible by {n}; pass "
                "input_split_sizes and output_split_sizes"
            )
        in_splits = out_splits = [rows // n] * n
    else:
        in_splits = checks.split_sizes(input_split_sizes, n, rows, "input_split_sizes")
        out_splits = checks.split_sizes(output_split_sizes, n, None, "output_split_sizes")
    out_shape = (sum(out_splits), *tensor.shape[1:])
    _check_out(out, out_shape, tensor.dtype, "this all_to_all")
    row_bytes = _row_bytes(tensor, 0)
    sent = (rows - in_splits[info.rank]) * row_bytes
    event = _begin("all_to_all", info, (tensor,), (out_shape,), (tensor.dtype,), sent, async_op)
    if n == 1:
        return _local(_deliver(tensor.clone(), out), event, async_op)
    x = tensor.contiguous()
    buf = out if out is not None and out.is_contiguous() else x.new_empty(out_shape)
    send, recv = (x, buf) if checks.is_native(x.dtype, info.backend) else (x.view(torch.uint8), buf.view(torch.uint8))
    even = input_split_sizes is None
    work = _c10d.all_to_all_single(
        recv, send,
        output_split_sizes=None if even else out_splits,
        input_split_sizes=None if even else in_splits,
        group=group, async_op=async_op,
    )
    return _end(work, lambda: _deliver(buf, out), event, async_op)
