"""Redistributing a DTensor whose placements hold a _StridedShard.

    src --(1) all-gather each strided axis--> plain src'  (the strided axis now Replicate)
        --(2) the plain plan (redistribute.plan)--> plain dst'
        --(3) chunk each strided axis of dst--> dst

A _StridedShard axis cuts its dim after every other axis that cuts it (placement.shard_order),
so its piece is the innermost cut: gathering over that axis alone rebuilds what the other
axes hold (for FSDP over TP, the TP-local tensor), and cutting the local tensor by it is
step (3). Sizes come from local_shape_and_offset of the placements at that point; the ranks
of one axis group share their coordinates on every other axis, so they agree on them.
An interleaved _StridedShard (no other axis cuts its dim: placement.interleaved) gathers
and chunks block by block (Step.blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from plait.tensor.placement import (
    Placement,
    Replicate,
    _StridedShard,
    chunk_sizes,
    interleaved,
    local_shape_and_offset,
    shard_order,
)
from plait.tensor.redistribute import Step


def plan(
    shape: Sequence[int],
    src: Sequence[Placement],
    dst: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    plain: Callable[..., tuple[Step, ...]],
) -> tuple[Step, ...]:
    """The steps from `src` to `dst` (either holding a _StridedShard); `plain` plans the rest."""
    src, dst = tuple(src), tuple(dst)
    if src == dst:
        return ()
    shard_order(dst, mesh_shape)  # a user's dst that is no valid layout fails here, by name
    steps: list[Step] = []
    cur = list(src)
    src_blocks, dst_blocks = interleaved(src, mesh_shape), interleaved(dst, mesh_shape)
    for axis in reversed(range(len(cur))):
        p = cur[axis]
        if type(p) is not _StridedShard:
            continue
        cur[axis] = Replicate()
        size = local_shape_and_offset(shape, cur, mesh_shape, coordinate)[0][p.dim]
        sf = src_blocks.get(axis, 1)  # an interleaved piece is sf chunks, one per block
        sizes = tuple(sf * c for c in chunk_sizes(size // sf, mesh_shape[axis]))
        steps.append(Step("all_gather", axis, p.dim, sizes, blocks=sf))
    mid = [Replicate() if type(p) is _StridedShard else p for p in dst]
    steps += plain(shape, cur, mid, mesh_shape, coordinate)
    cur = mid
    for axis, p in enumerate(dst):
        if type(p) is not _StridedShard:
            continue
        size = local_shape_and_offset(shape, cur, mesh_shape, coordinate)[0][p.dim]
        sf = dst_blocks.get(axis, 1)
        steps.append(Step("chunk", axis, p.dim, tuple(sf * c for c in chunk_sizes(size // sf, mesh_shape[axis])),
                          blocks=sf))
        cur[axis] = p
    return tuple(steps)


def unstrided(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """`placements` with every _StridedShard axis gathered (Replicate): the cheapest plain
    layout a strided DTensor reaches, one all-gather per strided axis."""
    return tuple(Replicate() if type(p) is _StridedShard else p for p in placements)


__all__ = ["plan", "unstrided"]
