"""The door inside compiled graphs: traceable collectives that the listeners still see.

    traced code:  x -> plait::collective_start(x, meta) -> c10d functional collective
                    -> wait_tensor -> plait::collective_end(out) -> result
    graph run:    collective_start: seq += 1 on its group -> [listeners] on_start (the
                  flight recorder's entry, CommDebugMode's count, DETAIL's check, which
                  may raise before anything is sent) -> the collective, async, as the
                  compiler scheduled it -> wait -> collective_end: [listeners] on_end

While torch.compile traces (DTensor's redistribute under AOTAutograd), tensors are fake and
an eager c10d call cannot run; c10d's functional ops (`torch.ops._c10d_functional.*`) are
what a graph holds instead. They run when the compiled graph runs, but out of plait's
sight, so each is bracketed by two small plait ops whose eager kernels are the door's
bookkeeping. The collective itself stays c10d's functional op, so Inductor still sees a
collective and a wait it may move apart to overlap communication with compute (a custom
op that called plait.comm eagerly would be opaque and synchronous). The brackets are
ordered by data: the collective takes collective_start's output, collective_end takes the
waited result; each returns a fresh tensor (a custom op may not return its input), one
copy of the logical input and output per collective.

Uneven pieces are padded to the widest, as c10d's tensor collectives need equal ones; the
events carry the logical (unpadded) shapes, the bytes the padded wire.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from plait.comm import collectives, events
from plait.comm.group import group_info

_fc = torch.ops._c10d_functional
# group name -> events started by collective_start and not yet ended, oldest first (the
# ops of one group complete in issue order)
_pending: dict[str, collections.deque] = collections.defaultdict(collections.deque)


@torch.library.custom_op("plait::collective_start", mutates_args=())
def collective_start(x: torch.Tensor, op: str, group_name: str, reduce_op: str, output_shape: list[int],
                     bytes_sent: int) -> torch.Tensor:
    """Announce a graph collective at the door; returns a copy of `x` for it to send."""
    info = group_info(_resolve_process_group(group_name))
    event = collectives._begin(op, info, (x,), (tuple(output_shape),), (x.dtype,), bytes_sent, True,
                               reduce_op=reduce_op or None, impl="functional")
    _pending[group_name].append(event)
    return x.clone()


@collective_start.register_fake
def _(x, op, group_name, reduce_op, output_shape, bytes_sent):
    return torch.empty_like(x)


@torch.library.custom_op("plait::collective_end", mutates_args=())
def collective_end(out: torch.Tensor, group_name: str) -> torch.Tensor:
    """The graph collective of `group_name` issued first and not yet ended has completed."""
    pending = _pending[group_name]
    event = pending.popleft() if pending else None
    if event is not None:
        events.emit_end(event)
    # contiguous, as plait.comm's eager results are: a later view (linear's (B*S, D) of an
    # all-gather on the sequence dim) needs it, and the copy is made here anyway
    return out.clone(memory_format=torch.contiguous_format)


@collective_end.register_fake
def _(out, group_name):
    return torch.empty_like(out, memory_format=torch.contiguous_format)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _fc.wait_tensor(t)


def all_reduce(x: torch.Tensor, group, op: str) -> torch.Tensor:
    """Traceable all-reduce of `x` over `group`; `op` as in plait.comm.all_reduce."""
    name, n = group.group_name, group.size()
    x = collective_start(x, "all_reduce", name, op, list(x.shape), int(2 * (n - 1) / n * _nbytes(x)))
    if op == "avg":  # not every backend reduces with AVG: sum, then divide
        out = _wait(_fc.all_reduce(x, "sum", name)) / n
    else:
        out = _wait(_fc.all_reduce(x, op, name))
    return collective_end(out, name)


def all_gather(x: torch.Tensor, group, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Traceable all-gather along `dim`; rank r contributes `sizes[r]` rows."""
    name, n, width = group.group_name, len(sizes), max(sizes)
    shape = list(x.shape)
    row_bytes = x.element_size() * math.prod([s for i, s in enumerate(shape) if i != dim])
    x = collective_start(x, "all_gather", name, "", shape[:dim] + [sum(sizes)] + shape[dim + 1:],
                         (n - 1) * width * row_bytes)
    rows = x.movedim(dim, 0)
    if rows.size(0) != width:
        rows = torch.cat([rows, rows.new_zeros((width - rows.size(0), *rows.shape[1:]))])
    out = _wait(_fc.all_gather_into_tensor(rows.contiguous(), n, name))  # (n*width, ...)
    if len(set(sizes)) > 1:
        out = torch.cat([out.narrow(0, r * width, s) for r, s in enumerate(sizes)])
    return collective_end(out.movedim(0, dim), name)


def reduce_scatter(x: torch.Tensor, group, op: str, dim: int, sizes: Sequence[int], me: int) -> torch.Tensor:
    """Traceable reduce-scatter along `dim`; rank `me` keeps `sizes[me]` rows."""
    name, n, width = group.group_name, len(sizes), max(sizes)
    shape = list(x.shape)
    row_bytes = x.element_size() * math.prod([s for i, s in enumerate(shape) if i != dim])
    x = collective_start(x, "reduce_scatter", name, op, shape[:dim] + [sizes[me]] + shape[dim + 1:],
                         (n - 1) * width * row_bytes)
    rows = x.movedim(dim, 0)
    if len(set(sizes)) > 1:
        pieces = rows.split(list(sizes))
        rows = torch.cat([torch.cat([p, p.new_zeros((width - p.size(0), *p.shape[1:]))]) for p in pieces])
    reduce_op = "sum" if op == "avg" else op
    out = _wait(_fc.reduce_scatter_tensor(rows.contiguous(), reduce_op, n, name))
    if op == "avg":
        out = out / n
    return collective_end(out.narrow(0, 0, sizes[me]).movedim(0, dim), name)


def all_to_all(send: torch.Tensor, group, out_splits: Sequence[int], in_splits: Sequence[int]) -> torch.Tensor:
    """Traceable all-to-all of a flat `send`: `in_splits[r]` elements go to rank r."""
    name = group.group_name
    me = group.rank()
    send = collective_start(send, "all_to_all", name, "", [sum(out_splits)],
                            (send.numel() - in_splits[me]) * send.element_size())
    out = _wait(_fc.all_to_all_single(send, list(out_splits), list(in_splits), name))
    return collective_end(out, name)


__all__ = ["all_gather", "all_reduce", "all_to_all", "collective_end", "collective_start", "reduce_scatter"]
