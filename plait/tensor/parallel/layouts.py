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

from collections.abc import Callable, Sequence

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


def boundary(mesh: DeviceMesh, layout: Placement, desired: Placement | None, *, use_local_output: bool,
             what: str, async_op: bool = False, check_input: bool = True,
             check_even: bool = True) -> Callable[[object], torch.Tensor]:
    """One input's or output's conversion: to a DTensor laid out `layout` (checked, unless
    not `check_input`: then a DTensor is taken from wherever it is), moved to `desired`
    (None: left), then its local piece if `use_local_output` (an even one, if `check_even`).

    The function is allowed in torch.compile graphs: Dynamo records the call as one node
    (its only argument the tensor; mesh and placements are constants of the closure),
    and AOTAutograd traces through it, collectives included, so a parallelized module
    compiles without a graph break at each hook.
    """
    final = desired if desired is not None else layout

    def convert(x):
        if use_local_output and check_even and isinstance(x, DTensor):  # before anything is sent
            p = Shard(final.dim % x.ndim) if isinstance(final, Shard) else final
            check_local(x.shape, (p,), mesh, what=what)
        if isinstance(x, DTensor) and not check_input:
            dt = move(x, layout, async_op=async_op and not torch.compiler.is_compiling())
        else:
            dt = to_dtensor(x, mesh, layout, what=what)
        if desired is not None:
            dt = move(dt, desired, async_op=async_op and not torch.compiler.is_compiling())
        return dt.to_local() if use_local_output else dt

    return torch._dynamo.allow_in_graph(convert)


def local_output(*, what: str) -> Callable[[DTensor], torch.Tensor]:
    """A DTensor's (even) local piece, as a function allowed in compiled graphs (see boundary)."""
    def convert(x: DTensor) -> torch.Tensor:
        check_local(x.shape, x.placements, x.device_mesh, what=what)
        return x.to_local()

    return torch._dynamo.allow_in_graph(convert)


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


__all__ = ["as_tuple", "boundary", "check_local", "local_output", "move", "same_layout", "to_dtensor"]
