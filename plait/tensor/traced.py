"""Collectives while torch.compile traces DTensor code: c10d's functional collective ops.

    eager:   redistribute -> plait.comm (checks, listeners, CommDebugMode)
    traced:  redistribute -> torch.ops._c10d_functional.* + wait_tensor -> ops in the graph

When AOTAutograd traces through DTensor's dispatch, local tensors are fake (no data), and
plait.comm's eager c10d calls cannot run on them. The functional ops are what c10d offers
for graphs (DESIGN.md lists them with c10d): they record the collective in the graph and
run it when the compiled graph runs, on the same process group. They bypass plait.comm's
listeners at run time, so CommDebugMode does not count collectives inside a compiled graph.
TODO(comm): move this into plait.comm as its traceable door, so listeners see graph
collectives too; plait.tensor would then only call plait.comm.

Uneven pieces are padded to the widest, as c10d's tensor collectives need equal ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from plait import comm

_fc = torch.ops._c10d_functional


def is_traced(t: torch.Tensor) -> bool:
    """Whether `t` is a tracing stand-in (fake or functional) rather than real data."""
    return isinstance(t, FakeTensor) or torch._is_functional_tensor(t) or type(t).__name__ == "FunctionalTensor"


def _name(group) -> str:
    return group.group_name


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _fc.wait_tensor(t)


def all_reduce(x: torch.Tensor, group, op: str) -> torch.Tensor:
    if op == "avg":  # not every backend reduces with AVG: sum, then divide
        n = comm.get_world_size(group)
        return _wait(_fc.all_reduce(x, "sum", _name(group))) / n
    return _wait(_fc.all_reduce(x, op, _name(group)))


def all_gather(x: torch.Tensor, group, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    n, width = len(sizes), max(sizes)
    rows = x.movedim(dim, 0)
    if rows.size(0) != width:
        rows = torch.cat([rows, rows.new_zeros((width - rows.size(0), *rows.shape[1:]))])
    out = _wait(_fc.all_gather_into_tensor(rows.contiguous(), n, _name(group)))  # (n*width, ...)
    if len(set(sizes)) > 1:
        out = torch.cat([out.narrow(0, r * width, s) for r, s in enumerate(sizes)])
    # contiguous, as plait.comm's eager result is: a later view (linear's (B*S, D)) needs it
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, group, op: str, dim: int, sizes: Sequence[int], me: int) -> torch.Tensor:
    n, width = len(sizes), max(sizes)
    rows = x.movedim(dim, 0)
    if len(set(sizes)) > 1:
        pieces = rows.split(list(sizes))
        rows = torch.cat([torch.cat([p, p.new_zeros((width - p.size(0), *p.shape[1:]))]) for p in pieces])
    reduce_op = "sum" if op == "avg" else op
    out = _wait(_fc.reduce_scatter_tensor(rows.contiguous(), reduce_op, n, _name(group)))
    if op == "avg":
        out = out / n
    return out.narrow(0, 0, sizes[me]).movedim(0, dim).contiguous()


def all_to_all(send: torch.Tensor, group, out_splits: Sequence[int], in_splits: Sequence[int]) -> torch.Tensor:
    return _wait(_fc.all_to_all_single(send, list(out_splits), list(in_splits), _name(group)))


__all__ = ["all_gather", "all_reduce", "all_to_all", "is_traced", "reduce_scatter"]
