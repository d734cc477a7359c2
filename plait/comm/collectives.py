"""The collectives that keep a tensor's shape (all-reduce, broadcast, reduce, barrier),
and the steps every collective shares.

    check inputs -> seq += 1 -> choose implementation -> [listeners] on_start
                 -> issue the c10d op -> Handle(work, finish) -> wait() or return it

Each takes its group explicitly and `async_op`: False returns the result, True a `Handle`
whose `wait()` returns it. Ranks (`src`, `dst`) are ranks *within* the group. Bytes are
counted with the ring model: all-reduce sends 2(N-1)/N·S per rank. The collectives that
change a tensor's shape (gather, scatter, all-to-all) are in `gathers.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from plait.comm import _c10d, checks, events, shutdown
from plait.comm.eager import eager_only
from plait.comm.group import GroupInfo, group_info
from plait.comm.work import Handle, completed

_C10D_OPS = {
    "sum": _c10d.ReduceOp.SUM,
    "avg": _c10d.ReduceOp.AVG,
    "max": _c10d.ReduceOp.MAX,
    "min": _c10d.ReduceOp.MIN,
    "product": _c10d.ReduceOp.PRODUCT,
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _begin(
    op: str,
    info: GroupInfo,
    inputs: Sequence[torch.Tensor],
    output_shapes: Sequence[tuple[int, ...]],
    output_dtypes: Sequence[torch.dtype],
    bytes_sent: float,
    async_op: bool,
    reduce_op: str | None = None,
    impl: str = "native",
    peer: int | None = None,
) -> events.CommEvent | None:
    info.seq += 1
    if not events._listeners:
        return None
    event = events.CommEvent(
        op=op,
        group_name=info.name,
        group_ranks=info.ranks,
        rank=info.rank,
        seq=info.seq,
        input_shapes=(tuple(inputs[0].shape),) if len(inputs) == 1 else tuple(tuple(t.shape) for t in inputs),
        input_dtypes=(inputs[0].dtype,) if len(inputs) == 1 else tuple(t.dtype for t in inputs),
        output_shapes=tuple(output_shapes),
        output_dtypes=tuple(output_dtypes),
        bytes_sent=int(bytes_sent),
        reduce_op=reduce_op,
        impl=impl,
        async_op=async_op,
        peer=peer,
    )
    events.emit_start(event)
    return event


def _end(work: Any, finish: Callable[[], Any], event: events.CommEvent | None, async_op: bool) -> Any:
    """Wrap an issued op. A synchronous op was issued with c10d's own async_op=False, so
    c10d waited for it in C++ and `work` is None: no Python-held Work outlives the call
    (one held past a Gloo op's completion can abort the process at exit, pytorch#190489)."""
    handle = Handle(work, finish, event)
    if not async_op:
        return handle.wait()
    if work is not None:
        shutdown.track(handle)
    return handle


def _local(result: Any, event: events.CommEvent | None, async_op: bool) -> Any:
    """Finish an op that a group of one completes without communication."""
    handle = completed(result, event)
    return handle if async_op else result


@eager_only
def all_reduce(tensor: torch.Tensor, *, group: ProcessGroup, op: str = "sum", async_op: bool = False) -> Any:
    """Reduce `tensor` across the group in place; every rank gets the result."""
    info = group_info(group)
    checks.tensor(tensor, "tensor", info, in_place=True)
    op = checks.reduce_op(op, tensor.dtype, info.backend)
    n = info.size
    event = _begin("all_reduce", info, (tensor,), (tuple(tensor.shape),), (tensor.dtype,),
                   2 * (n - 1) / n * _nbytes(tensor), async_op, reduce_op=op)
    if n == 1:
        return _local(tensor, event, async_op)
    work = _c10d.all_reduce(tensor, op=_C10D_OPS[op], group=group, async_op=async_op)
    return _end(work, lambda: tensor, event, async_op)


@eager_only
def broadcast(tensor: torch.Tensor, *, src: int, group: ProcessGroup, async_op: bool = False) -> Any:
    """Copy group rank `src`'s `tensor` into `tensor` on every rank, in place."""
    info = group_info(group)
    checks.tensor(tensor, "tensor", info, in_place=True)
    if not 0 <= src < info.size:
        raise ValueError(f"src {src} is not a rank of group {info.name} (size {info.size})")
    sent = _nbytes(tensor) if info.rank == src else 0
    event = _begin("broadcast", info, (tensor,), (tuple(tensor.shape),), (tensor.dtype,), sent, async_op,
                   peer=src)
    if info.size == 1:
        return _local(tensor, event, async_op)
    wire = tensor if checks.is_native(tensor.dtype, info.backend) else tensor.view(-1).view(torch.uint8)
    work = _c10d.broadcast(wire, group=group, group_src=src, async_op=async_op)
    return _end(work, lambda: tensor, event, async_op)


@eager_only
def reduce(tensor: torch.Tensor, *, dst: int, group: ProcessGroup, op: str = "sum", async_op: bool = False) -> Any:
    """Reduce `tensor` across the group into group rank `dst`'s `tensor`, in place; the
    other ranks' tensors are left unspecified (c10d may use them as scratch)."""
    info = group_info(group)
    checks.tensor(tensor, "tensor", info, in_place=True)
    op = checks.reduce_op(op, tensor.dtype, info.backend)
    if not 0 <= dst < info.size:
        raise ValueError(f"dst {dst} is not a rank of group {info.name} (size {info.size})")
    event = _begin("reduce", info, (tensor,), (tuple(tensor.shape),), (tensor.dtype,),
                   0 if info.rank == dst else _nbytes(tensor), async_op, reduce_op=op, peer=dst)
    if info.size == 1:
        return _local(tensor, event, async_op)
    if op == "avg":  # c10d's reduce has no AVG on every backend: sum, then divide at dst
        work = _c10d.reduce(tensor, group=group, group_dst=dst, op=_c10d.ReduceOp.SUM, async_op=async_op)
        finish = (lambda: tensor.div_(info.size)) if info.rank == dst else (lambda: tensor)
        return _end(work, finish, event, async_op)
    work = _c10d.reduce(tensor, group=group, group_dst=dst, op=_C10D_OPS[op], async_op=async_op)
    return _end(work, lambda: tensor, event, async_op)


@eager_only
def barrier(*, group: ProcessGroup, async_op: bool = False) -> Any:
    """Return once every rank of the group has entered the barrier."""
    info = group_info(group)
    event = _begin("barrier", info, (), (), (), 0, async_op)
    if info.size == 1:
        return _local(None, event, async_op)
    work = _c10d.barrier(group=group, async_op=async_op)
    return _end(work, lambda: None, event, async_op)
