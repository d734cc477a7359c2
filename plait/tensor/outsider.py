"""Ops on a rank outside a DTensor's mesh: nothing runs, every result is an empty piece.

    DTensor args on a mesh without this rank -> OutsiderPlan (built once, cached by dispatch)
        op writes its args in place  -> the same DTensors back, untouched
        op returns tensors           -> DTensors of the planned global specs over empty
                                        locals: zeros(()) for a 0-dim result, else a 1-D empty
        op returns anything else     -> None

This is torch's non-participating rank (DeviceMesh._is_current_rank_part_of_mesh): a
sub-mesh's members compute and communicate among themselves, the ranks outside follow the
same program with the same global shapes and take part in no collective, so they can
never hold the members up. The output placements are the ones the members' plan chooses
(global specs only: no coordinate is needed), else Replicate.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from plait.tensor import fallback
from plait.tensor.dtensor import wrap
from plait.tensor.placement import Replicate
from plait.tensor.spec import DTensorSpec


class OutsiderPlan:
    """dispatch's plan for a call on a rank outside the call's mesh (see the module note)."""

    __slots__ = ("returns", "out_specs", "tree", "device")
    fast = None  # dispatch's fast paths run the op; this plan never does
    fast_inplace = None

    def __init__(self, returns, out_specs, tree, device: str) -> None:
        self.returns, self.out_specs, self.tree, self.device = returns, out_specs, tree, device

    def run(self, args: tuple, kwargs: dict, dts: list):
        if self.returns is not None:
            r = self.returns
            return dts[r[0]] if len(r) == 1 else (tuple(dts[k] for k in r) if r else None)
        if self.tree is None:
            return None
        leaves = []
        for spec in self.out_specs:
            if spec is None:
                leaves.append(None)
                continue
            shape = () if len(spec.shape) == 0 else (0,)
            leaves.append(wrap(torch.zeros(shape, dtype=spec.dtype, device=self.device), spec))
        return tree_unflatten(leaves, self.tree)


def plan(op, args, kwargs, mesh, returns, build_members_plan) -> OutsiderPlan:
    """The outsider's plan for `op`; `build_members_plan()` gives the members' (for their
    output placements; it may fail without a coordinate, then outputs are Replicate)."""
    device = mesh.device_type
    if returns is not None:
        return OutsiderPlan(returns, (), None, device)
    try:
        out = op(*fallback._to_meta(list(args)), **{k: fallback._to_meta(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - no meta kernel: torch's outsider returns None as well
        return OutsiderPlan(None, (), None, device)
    leaves, tree = tree_flatten(out)
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        return OutsiderPlan(None, (), None, device)
    replicate = (Replicate(),) * mesh.ndim
    specs = [DTensorSpec(mesh, replicate, tuple(x.shape), tuple(x.stride()), x.dtype)
             if isinstance(x, torch.Tensor) else None for x in leaves]
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) or x is None]
    try:
        planned = list(build_members_plan().out_specs)  # one per tensor-or-None output
    except Exception:  # noqa: BLE001 - a rule that needs this rank's coordinate
        planned = []
    if len(planned) == len(slots):
        for i, spec in zip(slots, planned):
            specs[i] = spec if isinstance(leaves[i], torch.Tensor) else None
    return OutsiderPlan(None, specs, tree, device)


__all__ = ["OutsiderPlan", "plan"]
