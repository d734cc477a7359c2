"""Ops that return Python values or compare whole tensors: item, equal, is_same_size; and
resize_, refused unless it keeps the shape.

    _local_scalar_dense (item)  gathers to Replicate, then reads the local value
    is_same_size                compares global shapes: no communication
    equal                       brings b to a's placements (Partial -> Replicate), compares
                                locally, and all-reduces the verdict (min) over the mesh
"""

from __future__ import annotations

import torch

from plait import comm
from plait.tensor.ops.registry import OpCall, Sharding, aten, register
from plait.tensor.placement import Partial, Replicate


@register(aten._local_scalar_dense.default)
def item_rule(call: OpCall) -> Sharding:
    return Sharding((tuple(Replicate() for _ in call.specs[0].placements),), ())


@register(aten.is_same_size.default)
def is_same_size_rule(call: OpCall) -> Sharding:
    same = call.specs[0].shape == call.specs[1].shape
    return Sharding((None, None), (), lambda args, kwargs: same)


@register(aten.equal.default)
def equal_rule(call: OpCall) -> Sharding:
    a, b = call.specs
    target = tuple(Replicate() if isinstance(p, Partial) else p for p in a.placements)
    if a.shape != b.shape:
        return Sharding((None, None), (), lambda args, kwargs: False)
    mesh = call.mesh

    def run(args, kwargs):
        verdict = torch.tensor([int(torch.equal(args[0], args[1]))], device=args[0].device)
        for axis in range(mesh.ndim):
            comm.all_reduce(verdict, group=mesh.get_group(axis), op="min")
        return bool(verdict.item())

    return Sharding((target, target), (), run)




@register(aten.resize_.default, aten.resize_as_.default)
def resize_rule(call: OpCall) -> Sharding:
    """A no-op resize passes; any other is refused: it would resize each rank's piece, not
    the global tensor, and leave the DTensor's shape as it was."""
    spec = call.specs[0]
    size = tuple(call.specs[1].shape) if call.op is aten.resize_as_.default else tuple(call.args[1])
    if size != tuple(spec.shape):
        raise NotImplementedError(
            f"{call.op} of a DTensor from {tuple(spec.shape)} to {size}: a DTensor's shape is global "
            "and each rank holds a piece; make a new DTensor of the new shape (distribute_tensor, "
            "new_empty) instead")
    return Sharding(tuple(None for _ in call.specs), (spec.placements,))


__all__ = ["equal_rule", "is_same_size_rule", "item_rule", "resize_rule"]
