"""from_local's global shape and `run_check`: what the ranks' local tensors must agree on.

    even_global_shape      no communication: every Shard axis multiplies its dim by n
    gathered_global_shape  all-gathers the local sizes, innermost axis first, so uneven
                           (torch.chunk) shards give the true global shape
    check_meta             every rank's local has one dtype and one requires_grad, and, where
                           the global shape is not given and the pieces' shapes agree, one
                           stride (torch's check_tensor_meta: a transposed piece is refused)
    check_and_sync         every rank's local shape is its torch.chunk piece of the global
                           shape (else every rank raises, with the numbers), and Replicate
                           axes take coordinate 0's data

A check that fails on one rank fails on all of them: the verdict is all-reduced over
every mesh axis before anyone raises, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from plait import comm
from plait.device_mesh import DeviceMesh
from plait.tensor.placement import (
    Placement,
    Replicate,
    Shard,
    _StridedShard,
    chunk_sizes,
    local_shape_and_offset,
)


def even_global_shape(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[int, ...]:
    shape = list(local.shape)
    for axis, p in enumerate(placements):
        if type(p) is Shard or type(p) is _StridedShard:
            shape[p.dim] *= mesh.size(axis)
    return tuple(shape)


def gathered_global_shape(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[int, ...]:
    shape = list(local.shape)
    errors = []
    # undo the cuts innermost first: a _StridedShard axis cuts its dim last
    axes = sorted(reversed(range(mesh.ndim)), key=lambda a: type(placements[a]) is not _StridedShard)
    for axis in axes:
        p = placements[axis]
        if type(p) is not Shard and type(p) is not _StridedShard:
            continue
        group = mesh.get_group(axis)
        sizes = comm.all_gather(torch.tensor([shape[p.dim]], device=comm.group_device(group)), group=group).tolist()
        total = sum(sizes)
        # (a strided axis's sizes are checked below, with the whole shape known)
        if type(p) is Shard and sizes != chunk_sizes(total, len(sizes)):
            errors.append(f"mesh axis {axis} holds sizes {sizes} along dim {p.dim}, which is not "
                          f"torch.chunk's split {chunk_sizes(total, len(sizes))} of {total}")
        shape[p.dim] = total
    _agree(mesh, "; ".join(errors))
    return tuple(shape)


def check_meta(local: torch.Tensor, mesh: DeviceMesh, *, stride: bool) -> None:
    """Raise on every rank if the mesh's ranks disagree on the local's dtype or requires_grad,
    or (`stride`, with equal local shapes) on its stride, naming this rank's."""
    mine = {"dtype": str(local.dtype), "requires_grad": local.requires_grad, "shape": tuple(local.shape),
            "stride": (tuple(local.shape), local.stride())}
    keys = ["dtype", "requires_grad", "shape"] + (["stride"] if stride else [])
    codes = torch.tensor([zlib.crc32(repr(mine[k]).encode()) for k in keys], dtype=torch.int64,
                         device=comm.group_device(mesh.get_group(0)))
    both = torch.cat([codes, -codes])  # max of both halves: every rank's code equal iff max == min
    for axis in range(mesh.ndim):
        comm.all_reduce(both, group=mesh.get_group(axis), op="max")
    n = len(keys)
    differ = [k for i, k in enumerate(keys) if int(both[i]) != -int(both[n + i])]
    if "shape" in differ:
        differ.remove("shape")  # uneven pieces are checked against the global shape later
        if "stride" in differ:
            differ.remove("stride")  # strides of pieces of other shapes differ as a matter of course
    if differ:
        raise ValueError(
            "from_local(run_check=True): Inconsistent tensor metadata (including shape and stride) across "
            f"ranks: they differ in {', '.join(differ)}; rank {mesh.get_rank()} has "
            + ", ".join(f"{k}={mine[k] if k != 'stride' else mine[k][1]}" for k in differ))


def check_and_sync(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
                   shape: Sequence[int]) -> torch.Tensor:
    expected, _ = local_shape_and_offset(shape, placements, mesh.shape, mesh.get_coordinate())
    error = ""
    if tuple(local.shape) != expected:
        error = (f"rank {mesh.get_rank()} holds a local tensor of shape {tuple(local.shape)}, but its "
                 f"piece of the global shape {tuple(shape)} with placements {list(placements)} is "
                 f"{expected}")
    _agree(mesh, error)
    base = synced = local.detach()
    for axis, p in enumerate(placements):
        if type(p) is Replicate and mesh.size(axis) > 1:
            synced = comm.broadcast(synced.contiguous().clone(), src=0, group=mesh.get_group(axis))
    if synced is base:
        return local
    if not local.requires_grad:
        return synced
    return local + (synced - local).detach()  # coordinate 0's values; the gradient still flows


def _agree(mesh: DeviceMesh, error: str) -> None:
    """Raise on every rank if any rank of the mesh has an error."""
    flag = torch.tensor([1 if error else 0], device=comm.group_device(mesh.get_group(0)))
    for axis in range(mesh.ndim):
        comm.all_reduce(flag, group=mesh.get_group(axis), op="max")
    if flag.item():
        raise ValueError(f"from_local(run_check=True): {error or 'another rank of the mesh failed the check'}")


__all__ = ["check_and_sync", "check_meta", "even_global_shape", "gathered_global_shape"]
