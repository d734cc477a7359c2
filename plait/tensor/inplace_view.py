"""In-place view ops (squeeze_, unsqueeze_, t_, transpose_, swapdims_, ...): a DTensor that
changes its own shape.

    plan of the out-of-place twin (squeeze_.dim -> squeeze.dim)  -> its output spec
    local  = the twin's local op on this rank's piece (a view of it: storage shared)
    dt._local, dt._spec = local, the twin's output spec
    the wrapper's sizes and strides: the op run on it as a meta tensor (torch's
    return_and_correct_aliasing does exactly this for wrapper subclasses)

The twin's rule decides the placements (unsqueeze_ renumbers a Shard past the new dim);
where it would move the input first, the move happens in place before the view.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from plait.tensor import redistribute as redist

aten = torch.ops.aten


def twin(op):
    """squeeze_.dim -> squeeze.dim, or None (as_strided_ has no rule-based twin)."""
    name = op._overloadpacket.__name__
    if not name.endswith("_") or name.startswith("as_strided"):
        return None
    packet = getattr(aten, name[:-1], None)
    if packet is None:
        return None
    overload = _OVERLOAD.get(str(op), op._overloadname)
    return getattr(packet, overload, None)


_OVERLOAD = {"aten.transpose_.default": "int"}  # the twin's overload has another name


class InplaceViewPlan:
    __slots__ = ("op", "twin_plan")
    fast = None
    fast_inplace = None

    def __init__(self, op, twin_plan) -> None:
        self.op, self.twin_plan = op, twin_plan

    def run(self, args, kwargs, dts):
        plan = self.twin_plan
        dt = dts[0]
        steps = plan.steps[0]
        local = dt._local_tensor
        if steps is not None:  # the twin wants another layout first: move in place
            local = redist.run(local, steps, plan.mesh)
        la = [local, *args[1:]]
        new_local = plan.local_fn(la, dict(kwargs)) if plan.local_fn is not None else plan.raw_op(*la, **kwargs)
        dt._local, dt._pending, dt._spec = new_local, None, plan.out_specs[0]
        return return_and_correct_aliasing(self.op, args, kwargs, dt)


__all__ = ["InplaceViewPlan", "twin"]
