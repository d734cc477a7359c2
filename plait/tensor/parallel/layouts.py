"""Layouts at a module's boundary: a plain tensor or DTensor in, a DTensor with the
declared placement out, checked.

    declared layout L, desired layout D (one mesh axis: parallelize_module takes 1-D meshes)
    plain tensor x   -> DTensor.from_local(x, mesh, (L,))   (x is this rank's piece under L)
    DTensor x        -> x, if its placements are (L,)  — else a ValueError naming both
    then, if D differs from L: redistribute to (D,)

The check is where plait is stricter than torch, which would redistribute a DTensor from
whatever placements it has: a DTensor that disagrees with the plan means the plan does
not describe the model, and the collectives it would silently add are the bug.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.device_mesh import DeviceMesh
from plait.tensor.dtensor import DTensor
from plait.tensor.placement import Placement, Shard
from plait.tensor.spec import same_mesh


def same_layout(a: Placement, b: Placement, ndim: int) -> bool:
    """Placements equal after making a negative Shard dim non-negative for `ndim` dims."""
    if isinstance(a, Shard) and isinstance(b, Shard):
        return a.dim % max(ndim, 1) == b.dim % max(ndim, 1)
    return a == b


def to_dtensor(x: object, mesh: DeviceMesh, layout: Placement, *, what: str) -> DTensor:
    """`x` as a DTensor laid out as `layout` on the 1-D `mesh` (see the module docstring)."""
    if isinstance(x, DTensor):
        if not same_mesh(x.device_mesh, mesh):
            raise ValueError(f"{what} is a DTensor on {x.device_mesh}, but the plan's mesh is {mesh}")
        if len(x.placements) != 1 or not same_layout(x.placements[0], layout, x.ndim):
            raise ValueError(
                f"{what} is a DTensor with placements {list(x.placements)}, but the plan declares "
                f"its layout as {layout!r}; redistribute it first or declare the layout it has")
        return x
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} is a {type(x).__name__}, not a torch.Tensor or DTensor")
    return DTensor.from_local(x, mesh, (layout,), run_check=False)


def move(x: DTensor, layout: Placement, *, async_op: bool = False) -> DTensor:
    """`x` redistributed to (layout,), or `x` itself when it already has it."""
    if same_layout(x.placements[0], layout, x.ndim):
        return x
    return x.redistribute(placements=(layout,), async_op=async_op)


def check_local(shape: Sequence[int], placements: Sequence[Placement], mesh: DeviceMesh, *, what: str) -> None:
    """Refuse to hand out the local piece of an uneven Shard: the next style's from_local
    would take the pieces as even, and the ranks would disagree on the global shape."""
    for axis, p in enumerate(placements):
        n = mesh.size(axis)
        if isinstance(p, Shard) and shape[p.dim] % n:
            raise ValueError(
                f"{what} is Shard({p.dim}) of size {shape[p.dim]}, which does not divide by the mesh size {n}; "
                f"make dim {p.dim} (e.g. the sequence length under sequence parallel) a multiple of {n}, or "
                "pass use_local_output=False to keep the (unevenly sharded) DTensor")


def as_tuple(layouts: Placement | Sequence[Placement | None] | None, what: str) -> tuple | None:
    """One placement or a sequence (None entries: leave that input alone) as a tuple."""
    if layouts is None:
        return None
    if isinstance(layouts, Placement):
        return (layouts,)
    layouts = tuple(layouts)
    for p in layouts:
        if p is not None and not isinstance(p, Placement):
            raise TypeError(f"{what} holds {p!r}, which is not a Placement (Shard, Replicate, Partial) or None")
    return layouts


__all__ = ["as_tuple", "check_local", "move", "same_layout", "to_dtensor"]
