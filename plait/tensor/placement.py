"""Placements: how one mesh axis lays out a DTensor's global value.

    Shard(dim)          rank r along the axis holds piece r of torch.chunk(global, n, dim),
                        pieces padded with empty ones to n (7 on 4 -> 2,2,2,1; 2 on 4 -> 1,1,0,0)
    Replicate()         every rank holds the whole value
    Partial(reduce_op)  the value is reduce_op over the ranks' locals (sum, avg, max, min)
    _StridedShard(dim, split_factor=sf)
                        Shard(dim) cut after the later axes that shard `dim` over sf ranks in
                        all (torch's FSDP over TP): with (_StridedShard(0, sf=tp), Shard(0)) on
                        (dp, tp) rank (d, t) holds chunk(chunk(global, tp)[t], dp)[d]

A placement tuple has one entry per mesh axis, applied in axis order: with
(Shard(0), Shard(0)) axis 0 chunks dim 0 first and axis 1 chunks each piece again. A
_StridedShard axis is the exception: it cuts its dim last among the axes it waits for
(`shard_order`), so every rank's piece is still one block of the global tensor. The
functions below are pure (sizes and coordinates in, sizes and offsets out), so the
layout logic is tested without processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PARTIAL_OPS = ("sum", "avg", "max", "min")
LINEAR_OPS = ("sum", "avg")  # reductions a linear map commutes with


class Placement:
    """Base class; placements are small immutable hashable values."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Shard(Placement):
    """Shard along tensor dim `dim` (torch.chunk semantics, uneven allowed)."""

    dim: int

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def _split_tensor(self, tensor, num_chunks: int, *, with_padding: bool = True,
                      contiguous: bool = True):
        """torch's helper: `tensor` cut along `dim` into `num_chunks` torch.chunk pieces (empty
        ones appended to reach `num_chunks`), each padded at its end to the first piece's size
        when `with_padding`; returns (pieces, pad size of each piece, [] without padding)."""
        import torch

        if not 0 <= self.dim < tensor.dim():
            raise ValueError(f"Shard({self.dim}) of a {tensor.dim()}-D tensor")
        sizes = chunk_sizes(tensor.size(self.dim), num_chunks)
        pieces = list(torch.split(tensor, sizes, dim=self.dim))
        full = sizes[0]
        pads = [full - s for s in sizes] if with_padding else []
        out = []
        for piece, pad in zip(pieces, pads or [0] * num_chunks):
            if pad:
                # F.pad's spec runs from the last dim backwards: (left, right) per dim
                spec = [0, 0] * (tensor.dim() - 1 - self.dim) + [0, pad]
                piece = torch.nn.functional.pad(piece, spec)
            out.append(piece.contiguous() if contiguous else piece)
        return out, pads

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"


class _StridedShard(Placement):
    """Shard(dim) applied after the later mesh axes that shard `dim` into `split_factor`
    pieces: torch's placement for FSDP's dp shard of a TP shard (torch's name and repr).
    Like torch's, it is not a Shard: `isinstance(p, Shard)` and `p.is_shard()` are False."""

    __slots__ = ("dim", "split_factor")

    def __init__(self, dim: int, *, split_factor: int = 1, sf: int | None = None) -> None:
        if sf is not None:
            if split_factor != 1:
                raise TypeError("_StridedShard received both split_factor and sf")
            split_factor = sf
        if not isinstance(split_factor, int) or split_factor < 1:
            raise ValueError(f"_StridedShard split_factor must be a positive int, got {split_factor!r}")
        object.__setattr__(self, "dim", int(dim))
        object.__setattr__(self, "split_factor", int(split_factor))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("_StridedShard is immutable")

    def __eq__(self, other: object) -> bool:
        return type(other) is _StridedShard and (self.dim, self.split_factor) == (other.dim, other.split_factor)

    def __hash__(self) -> int:
        return hash((_StridedShard, self.dim, self.split_factor))

    def __reduce__(self) -> tuple:
        return (_strided, (self.dim, self.split_factor))

    def __repr__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"


def _strided(dim: int, split_factor: int) -> _StridedShard:
    return _StridedShard(dim, split_factor=split_factor)


@dataclass(frozen=True, slots=True)
class Replicate(Placement):
    """Every rank along the axis holds the full value."""

    def is_replicate(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial(Placement):
    """The global value is `reduce_op` applied across the ranks' local tensors."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in PARTIAL_OPS and type(self) is Partial:
            raise ValueError(f"Partial reduce_op {self.reduce_op!r} is not one of {list(PARTIAL_OPS)}")

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    def is_linear(self) -> bool:
        """Whether a linear map f satisfies f(reduce(x)) == reduce(f(x)) for this placement."""
        return self.reduce_op in LINEAR_OPS

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"


@dataclass(frozen=True, slots=True)
class _NormPartial(Partial):
    """A partial p-norm: the global value is the p-norm of the ranks' local norms.

    Reduce: x^p -> all-reduce sum -> x^(1/p) (max / min for p = +-inf). What
    `vector_norm` of a sharded tensor returns, so clip_grad_norm_ needs one all-reduce.
    """

    norm_type: float = 2.0

    def __init__(self, norm_type: float = 2.0) -> None:
        op = "max" if norm_type == math.inf else "min" if norm_type == -math.inf else "sum"
        object.__setattr__(self, "reduce_op", op)
        object.__setattr__(self, "norm_type", float(norm_type))

    def is_linear(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"_NormPartial({self.norm_type:g})"

    def __str__(self) -> str:
        return f"P(norm{self.norm_type:g})"


def chunk_sizes(size: int, n: int) -> list[int]:
    """Sizes of torch.chunk(size, n), padded with zeros to n pieces."""
    per = -(-size // n) if size else 0
    return [max(0, min(per, size - i * per)) for i in range(n)]


def chunk_offset(size: int, n: int, index: int) -> tuple[int, int]:
    """(size, offset) of piece `index` of torch.chunk(size, n)."""
    per = -(-size // n) if size else 0
    start = min(size, index * per)
    return min(per, size - start), start


def normalize(placements: Sequence[Placement], ndim: int, mesh_ndim: int) -> tuple[Placement, ...]:
    """Validate a user's placements and make Shard dims non-negative."""
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(f"`placements` must have the same length as `device_mesh.ndim`! Found placements "
                         f"length: {len(placements)}, and device_mesh.ndim: {mesh_ndim} ({list(placements)}; "
                         "give one per mesh axis)")
    out = []
    for p in placements:
        if not isinstance(p, Placement):
            raise TypeError(f"placement {p!r} is not a Shard, Replicate or Partial")
        if isinstance(p, Shard):
            if not -ndim <= p.dim < max(ndim, 1) or ndim == 0:
                raise ValueError(f"Shard(dim={p.dim}) is out of range for a tensor with {ndim} dims")
            if p.dim < 0:
                p = Shard(p.dim + ndim)
        elif type(p) is _StridedShard:
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"{p!r} is out of range for a tensor with {ndim} dims")
            if p.dim < 0:
                p = _StridedShard(p.dim + ndim, split_factor=p.split_factor)
        out.append(p)
    ops = {p.reduce_op for p in out if isinstance(p, Partial) and type(p) is Partial}
    if len(ops) > 1:
        raise ValueError(f"placements {out} mix Partial reduce ops {sorted(ops)}; use one")
    return tuple(out)


def has_strided(placements: Sequence[Placement]) -> bool:
    return any(type(p) is _StridedShard for p in placements)


def shard_order(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> dict[int, list[int]]:
    """Per tensor dim, the mesh axes that chunk it, in the order they cut: axis order, but a
    _StridedShard(d, sf) axis waits until the later Shard(d) axes have cut d into sf pieces."""
    order: dict[int, list[int]] = {}
    waiting: dict[int, list[int]] = {}  # dim -> [strided axis, pieces still to wait for]
    for axis, p in enumerate(placements):
        if type(p) is Shard:
            order.setdefault(p.dim, []).append(axis)
            wait = waiting.get(p.dim)
            if wait is not None:
                if wait[1] % mesh_shape[axis]:
                    raise ValueError(f"{placements[wait[0]]!r} on mesh axis {wait[0]} waits for {wait[1]} more "
                                     f"pieces of dim {p.dim}, but axis {axis} cuts it into {mesh_shape[axis]}")
                wait[1] //= mesh_shape[axis]
                if wait[1] == 1:
                    order[p.dim].append(wait[0])
                    del waiting[p.dim]
        elif type(p) is _StridedShard:
            if p.dim in waiting:
                raise ValueError(f"placements {list(placements)} hold two _StridedShard of dim {p.dim}; "
                                 "one per dim is supported")
            if p.split_factor == 1:
                order.setdefault(p.dim, []).append(axis)
            else:
                waiting[p.dim] = [axis, p.split_factor]
    for dim, (axis, left) in waiting.items():
        if left == placements[axis].split_factor and len(order.get(dim, ())) == 0:
            order[dim] = [axis]  # interleaved: the only cut of its dim (see interleaved())
            continue
        raise ValueError(f"{placements[axis]!r} on mesh axis {axis} of {list(placements)} waits for later "
                         f"mesh axes to Shard({dim}) into {left} more pieces; a dim cut both by other "
                         "axes and by an interleaved _StridedShard is not supported")
    return order


def interleaved(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> dict[int, int]:
    """Axis -> split factor of each _StridedShard that no other axis cuts its dim for:
    torch's interleaved layout, dim d seen as (split_factor, block), each block chunked
    over the axis (what flattening (b, h) with h sharded makes of b*h: rank r holds chunk
    r of every block). A piece is not one slice of the dim: its offset is the first
    block's, its size split_factor * chunk."""
    found = {}
    for axis, p in enumerate(placements):
        if type(p) is _StridedShard and p.split_factor > 1 and not any(
                type(q) in (Shard, _StridedShard) and q.dim == p.dim for k, q in enumerate(placements) if k != axis):
            found[axis] = p.split_factor
    return found


def local_shape_and_offset(
    shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This coordinate's local shape and its offset into the global tensor, per dim."""
    sizes, offsets = list(shape), [0] * len(shape)
    if has_strided(placements):
        blocks = interleaved(placements, mesh_shape)
        for dim, axes in shard_order(placements, mesh_shape).items():
            for axis in axes:
                sf = blocks.get(axis, 1)
                size, start = chunk_offset(sizes[dim] // sf, mesh_shape[axis], coordinate[axis])
                sizes[dim] = size * sf
                offsets[dim] += start
        return tuple(sizes), tuple(offsets)
    for axis, p in enumerate(placements):
        if type(p) is Shard:
            size, start = chunk_offset(sizes[p.dim], mesh_shape[axis], coordinate[axis])
            sizes[p.dim] = size
            offsets[p.dim] += start
    return tuple(sizes), tuple(offsets)


def logical_size(
    shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    axis: int,
    dim: int,
) -> int:
    """Size of `dim` as axis `axis` sees it: after the axes before it have chunked it."""
    size = shape[dim]
    for a in range(axis):
        p = placements[a]
        if type(p) is Shard and p.dim == dim:
            size = chunk_offset(size, mesh_shape[a], coordinate[a])[0]
    return size


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def like_strides(shape: Sequence[int], model_stride: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for `shape` with the dim order (outermost first) of `model_stride`."""
    order = sorted(range(len(shape)), key=lambda d: (-model_stride[d], d))
    strides, acc = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = acc
        acc *= max(shape[d], 1)
    return tuple(strides)


__all__ = ["Partial", "Placement", "Replicate", "Shard", "_StridedShard", "chunk_offset", "chunk_sizes",
           "has_strided", "interleaved", "local_shape_and_offset", "shard_order"]
