"""Redistribute: move a local tensor from one placement tuple to another.

    plan(shape, src, dst, mesh_shape, coordinate)   pure: -> steps, one collective or
                                                    local op per (axis, step)
    run(local, steps, mesh)                         executes them through plait.comm

The plan has two passes. First, from the last mesh axis to the first, every axis whose
Shard must go is undone: Shard(i)->Shard(j) by an all-to-all where no other axis shards
i or j, else an all-gather to Replicate. An axis is also undone when an axis before it
changes how the same tensor dim is chunked, because nested chunks are cut in axis order
(Shard(0) on axes 0 and 1 cuts dim 0 by axis 0, then each piece by axis 1). Second, from
the first axis to the last, every remaining axis moves to its target:

    Partial -> Replicate   all-reduce          Replicate -> Shard     local chunk
    Partial -> Shard       reduce-scatter      Replicate -> Partial   keep on coordinate 0,
    Partial -> Partial'    all-reduce, then       zeros elsewhere (sum); keep (avg, max, min)
                           Replicate -> Partial'

Every size is torch.chunk's, so uneven and empty shards need nothing special. The
ranks of one axis group share their coordinates on every other axis, so each computes
the same sizes for the collectives it runs together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from plait import comm
from plait.device_mesh import DeviceMesh
from plait.tensor import traced
from plait.tensor.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _NormPartial,
    chunk_offset,
    chunk_sizes,
    has_strided,
    logical_size,
)


@dataclass(frozen=True)
class Step:
    """One move on one mesh axis. `sizes` are the axis's chunk sizes along `dim`."""

    kind: str  # all_gather | all_reduce | reduce_scatter | all_to_all | chunk | partition
    axis: int
    dim: int = -1
    sizes: tuple[int, ...] = ()
    dim2: int = -1  # all_to_all: the new shard dim
    sizes2: tuple[int, ...] = ()
    src: Placement | None = None  # the Partial being reduced (all_reduce, reduce_scatter)
    dst: Placement | None = None  # the Partial being created (partition)
    blocks: int = 1  # chunk, all_gather of an interleaved _StridedShard: dim is `blocks` blocks

    def __str__(self) -> str:
        where = f"axis {self.axis}" + (f" dim {self.dim}" if self.dim >= 0 else "")
        return f"{self.kind}({where})"


def plan(
    shape: Sequence[int],
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[Step, ...]:
    """The steps that take placements `src` to `dst` for a tensor of global `shape`."""
    if has_strided(src) or has_strided(dst):
        return strided.plan(shape, src, dst, mesh_shape, coordinate, plan)
    n_axes = len(mesh_shape)
    cur = list(src)
    undo, disturbed = set(), set()
    for i in range(n_axes):
        c, t = cur[i], dst[i]
        if type(c) is Shard and (t != c or c.dim in disturbed):
            undo.add(i)
            disturbed.add(c.dim)
        if type(t) is Shard and t != c:
            disturbed.add(t.dim)

    steps: list[Step] = []
    for i in reversed(range(n_axes)):
        if i not in undo:
            continue
        c, t = cur[i], dst[i]
        n = mesh_shape[i]
        if type(t) is Shard and t.dim != c.dim and _alone(i, (c.dim, t.dim), src, dst):
            size_from = logical_size(shape, cur, mesh_shape, coordinate, i, c.dim)
            size_to = logical_size(shape, cur, mesh_shape, coordinate, i, t.dim)
            steps.append(Step("all_to_all", i, c.dim, tuple(chunk_sizes(size_from, n)),
                              t.dim, tuple(chunk_sizes(size_to, n))))
            cur[i] = t
        else:
            size = logical_size(shape, cur, mesh_shape, coordinate, i, c.dim)
            steps.append(Step("all_gather", i, c.dim, tuple(chunk_sizes(size, n))))
            cur[i] = Replicate()

    for i in range(n_axes):
        c, t = cur[i], dst[i]
        if c == t:
            continue
        n = mesh_shape[i]
        if isinstance(c, Partial):
            if type(t) is Shard:
                size = logical_size(shape, cur, mesh_shape, coordinate, i, t.dim)
                steps.append(Step("reduce_scatter", i, t.dim, tuple(chunk_sizes(size, n)), src=c))
                cur[i] = t
                continue
            steps.append(Step("all_reduce", i, src=c))
            c = cur[i] = Replicate()
            if c == t:
                continue
        assert type(c) is Replicate, f"axis {i}: {c} should have been undone before moving to {t}"
        if type(t) is Shard:
            size = logical_size(shape, cur, mesh_shape, coordinate, i, t.dim)
            steps.append(Step("chunk", i, t.dim, tuple(chunk_sizes(size, n))))
        else:
            steps.append(Step("partition", i, dst=t))
        cur[i] = t
    return tuple(steps)


def _alone(axis: int, dims: tuple[int, int], src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """No other axis shards either dim, before or after: an all-to-all is then exact."""
    for j, (a, b) in enumerate(zip(src, dst)):
        if j != axis and any(type(p) is Shard and p.dim in dims for p in (a, b)):
            return False
    return True


_plans: dict = {}
MAX_CACHED = 8192


def plan_for(spec, placements: tuple[Placement, ...]) -> tuple[Step, ...]:
    """`plan` for a DTensorSpec on this rank, cached by (spec, placements)."""
    key = (spec, placements)
    steps = _plans.get(key)
    if steps is None:
        if len(_plans) >= MAX_CACHED:
            _plans.clear()
        steps = plan(spec.shape, spec.placements, placements, spec.mesh.shape, spec.mesh.get_coordinate())
        _plans[key] = steps
    return steps


# -- execution ------------------------------------------------------------------------------


class Pending:
    """A redistribution whose last collective is still in flight; `wait()` -> local tensor."""

    __slots__ = ("_handle", "_finish")

    def __init__(self, handle: comm.Handle, finish) -> None:
        self._handle, self._finish = handle, finish

    def wait(self) -> torch.Tensor:
        return self._finish(self._handle.wait())


def _pre(x: torch.Tensor, p: Placement) -> tuple[torch.Tensor, str]:
    """What to reduce and with which op for Partial `p` (p-norms reduce x^p by sum)."""
    if isinstance(p, _NormPartial) and p.reduce_op == "sum" and p.norm_type not in (0.0, 1.0):
        return x.pow(p.norm_type), "sum"
    return x, p.reduce_op


def _post(x: torch.Tensor, p: Placement) -> torch.Tensor:
    if isinstance(p, _NormPartial) and p.reduce_op == "sum" and p.norm_type not in (0.0, 1.0):
        return x.pow_(1.0 / p.norm_type)
    return x


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def run(local: torch.Tensor, steps: Sequence[Step], mesh: DeviceMesh, *, async_op: bool = False):
    """Apply `steps` to `local`; returns the new local tensor, or a `Pending` when
    `async_op` and the last step is a collective."""
    coordinate = mesh.get_coordinate()
    if steps and traced.is_traced(local):
        return _run_traced(local, steps, mesh, coordinate)
    if local.is_conj() or local.is_neg():
        # a collective reads raw memory: give it the values, not a lazy view of them
        local = local.resolve_conj().resolve_neg()
    last = len(steps) - 1
    for k, s in enumerate(steps):
        is_async = async_op and k == last
        kind = s.kind
        if kind == "chunk":
            local = _chunk(local, s, coordinate)
            continue
        if kind == "partition":
            local = _partition(local, s, coordinate)
            continue
        group = mesh.get_group(s.axis)
        finish = _identity
        if kind == "all_gather":
            out = comm.all_gather(local, group=group, dim=s.dim, sizes=s.sizes, async_op=is_async)
            if s.blocks > 1:
                finish = lambda y, s=s: _interleave(y, s)  # noqa: E731
        elif kind == "all_reduce":
            x, op = _pre(local, s.src)
            buf = x.clone(memory_format=torch.contiguous_format) if x is local else x.contiguous()
            out = comm.all_reduce(buf, group=group, op=op, async_op=is_async)
            finish = lambda y, p=s.src: _post(y, p)  # noqa: E731
        elif kind == "reduce_scatter":
            x, op = _pre(local, s.src)
            out = comm.reduce_scatter(x, group=group, op=op, dim=s.dim, sizes=s.sizes, async_op=is_async)
            finish = lambda y, p=s.src: _post(y, p)  # noqa: E731
        else:
            assert kind == "all_to_all", kind
            send, in_splits, out_splits, finish = _pack_all_to_all(local, s, coordinate[s.axis])
            out = comm.all_to_all(send, group=group, output_split_sizes=out_splits,
                                  input_split_sizes=in_splits, async_op=is_async)
        if is_async:
            return Pending(out, finish)
        local = finish(out)
    return local


def _run_traced(local: torch.Tensor, steps: Sequence[Step], mesh: DeviceMesh, coordinate) -> torch.Tensor:
    """The same steps while torch.compile traces: functional collectives (see traced.py)."""
    for s in steps:
        if s.kind == "chunk":
            local = _chunk(local, s, coordinate)
        elif s.kind == "partition":
            local = _partition(local, s, coordinate)
        elif s.kind == "all_gather":
            local = traced.all_gather(local, mesh.get_group(s.axis), s.dim, s.sizes)
            if s.blocks > 1:
                local = _interleave(local, s)
        elif s.kind == "all_reduce":
            x, op = _pre(local, s.src)
            local = _post(traced.all_reduce(x, mesh.get_group(s.axis), op), s.src)
        elif s.kind == "reduce_scatter":
            x, op = _pre(local, s.src)
            local = _post(traced.reduce_scatter(x, mesh.get_group(s.axis), op, s.dim, s.sizes,
                                                coordinate[s.axis]), s.src)
        else:
            send, in_splits, out_splits, finish = _pack_all_to_all(local, s, coordinate[s.axis])
            local = finish(traced.all_to_all(send, mesh.get_group(s.axis), out_splits or
                                             [send.numel() // len(s.sizes)] * len(s.sizes),
                                             in_splits or [send.numel() // len(s.sizes)] * len(s.sizes)))
    return local


def _chunk(local: torch.Tensor, s: Step, coordinate) -> torch.Tensor:
    if s.blocks > 1:  # each block's chunk: (blocks, block, ..) -> (blocks, chunk, ..) -> (blocks * chunk, ..)
        b = s.blocks
        size, start = chunk_offset(sum(s.sizes) // b, len(s.sizes), coordinate[s.axis])
        shape = list(local.shape)
        blocked = local.reshape(shape[:s.dim] + [b, shape[s.dim] // b] + shape[s.dim + 1:])
        return blocked.narrow(s.dim + 1, start, size).reshape(shape[:s.dim] + [b * size] + shape[s.dim + 1:])
    size, start = chunk_offset(sum(s.sizes), len(s.sizes), coordinate[s.axis])
    return local.narrow(s.dim, start, size)


def _interleave(gathered: torch.Tensor, s: Step) -> torch.Tensor:
    """The rank pieces of an interleaved dim, gathered one after another ([r0: blocks x c0,
    r1: blocks x c1, ..]), put back in block order ([block 0: c0, c1, ..; block 1: ..])."""
    b, d = s.blocks, s.dim
    shape = list(gathered.shape)
    pieces = [p.reshape(shape[:d] + [b, p.shape[d] // b] + shape[d + 1:])
              for p in gathered.split(list(s.sizes), dim=d)]
    return torch.cat(pieces, dim=d + 1).reshape(shape)


def _partition(local: torch.Tensor, s: Step, coordinate) -> torch.Tensor:
    if _partition_zeroes(s.dst) and coordinate[s.axis] != 0:
        return torch.zeros_like(local)
    return local


def _partition_zeroes(p: Placement) -> bool:
    """Replicate -> Partial keeps the value on coordinate 0 and zeros it elsewhere for a
    sum (exact, unlike dividing by n); avg, max and min of equal values are the value."""
    return p.reduce_op == "sum"


def _pack_all_to_all(local: torch.Tensor, s: Step, me: int):
    """Shard(dim) -> Shard(dim2): rank r gets my piece r along dim2, flattened; what
    arrives is concatenated along dim. Returns (send, in_splits, out_splits, finish),
    the splits None when every piece is the same size. Packing flat makes uneven pieces
    cost nothing extra: one copy to pack (none when dim2 is the outermost dim of a
    contiguous tensor), one to unpack (none when dim is)."""
    d_from, d_to = s.dim, s.dim2
    pieces = local.split(list(s.sizes2), dim=d_to)
    in_splits = [p.numel() for p in pieces]
    if d_to == 0 and local.is_contiguous():
        send = local.view(-1)
    else:
        send = local.new_empty(local.numel())
        offset = 0
        for p, n in zip(pieces, in_splits):
            send.narrow(0, offset, n).view(p.shape).copy_(p)
            offset += n
    shapes = []
    for size in s.sizes:
        shape = list(local.shape)
        shape[d_from], shape[d_to] = size, s.sizes2[me]
        shapes.append(shape)
    out_splits = [math.prod(sh) for sh in shapes]

    def finish(recv: torch.Tensor) -> torch.Tensor:
        if d_from == 0:  # row-major pieces stacked along dim 0 are the result's layout
            full = list(shapes[0])
            full[0] = sum(s.sizes)
            return recv.view(full)
        parts = [p.view(sh) for p, sh in zip(recv.split(out_splits), shapes)]
        return torch.cat(parts, dim=d_from)

    if len(set(in_splits)) == 1 and len(set(out_splits)) == 1:
        return send, None, None, finish
    return send, in_splits, out_splits, finish


# strided.py imports Step from this module; bound as a module so either may load first
from plait.tensor import strided  # noqa: E402

__all__ = ["Pending", "Step", "plan", "plan_for", "run"]
