"""Foreach ops over DTensors on several meshes: one call per mesh.

    _foreach_op([a0, a1, a2], [b0, b1, b2], scalar)    a0, a2 on mesh M; a1 on mesh K
      -> _foreach_op([a0, a2], [b0, b2], scalar)  on M  (planned and run as usual)
      -> _foreach_op([a1], [b1], scalar)          on K
      -> outputs (if any) put back in the original order

A foreach op is elementwise over its lists: element i of every list only meets element i
of the others, so the lists split by element without changing any result. An optimizer
meets this whenever its parameters live on different meshes: FSDP over tensor parallel
leaves the parameters TP did not touch on mesh["dp"] while the others are on the (dp,
tp) mesh, and torch.optim groups tensors by device and dtype only. Element i's mesh is
that of the first DTensor at index i of any list argument; inside one mesh group the
usual rule checks that every element agrees.

Indices that hold no DTensor (a TP model's norms, left plain, in the same parameter group)
form a group of their own (mesh None) whose call has plain tensors only: torch runs it
locally, as it would without DTensors. torch's DTensor raises on such lists; an optimizer
that picks foreach (the default on an accelerator) then fails on any model that mixes the
two kinds. A DTensor and a plain tensor of dim > 0 at one index are an error, as in any op.
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.tensor.dtensor import DTensor


def is_foreach(op) -> bool:
    return op.__name__.startswith("_foreach_")


class ByMeshPlan:
    """A plan for one foreach call signature whose lists span several meshes."""

    fast = None
    fast_inplace = None

    def __init__(self, op) -> None:
        self.op = op

    def run(self, args: tuple, kwargs: dict, dts: list[DTensor], groups: dict | None = None):
        n = next(len(a) for a in args if _is_list(a))
        results: list = [None] * n
        any_out = False
        # the plain indices last: a DTensor group's error (a plain tensor beside a DTensor at
        # one index, placements that disagree) comes before any plain tensor is written
        for _, idx in sorted((groups or split(args, kwargs)).items(), key=lambda g: g[0] is None):
            sub = tuple([a[i] for i in idx] if _is_list(a) and len(a) == n else a for a in args)
            sub_kwargs = {k: [v[i] for i in idx] if _is_list(v) and len(v) == n else v for k, v in kwargs.items()}
            out = self.op(*sub, **sub_kwargs)
            if out is not None and not (isinstance(out, Sequence) and len(out) == 0):
                any_out = True
                for i, o in zip(idx, out):
                    results[i] = o
        return results if any_out else None


def split(args: tuple, kwargs: dict) -> dict[object, list[int]]:
    """mesh -> the indices whose elements live on it (None: plain tensors only)."""
    lists = [a for a in (*args, *kwargs.values()) if _is_list(a)]
    n = len(lists[0])
    out: dict[object, list[int]] = {}
    for i in range(n):
        mesh = next((a[i]._spec.mesh for a in lists if len(a) == n and isinstance(a[i], DTensor)), None)
        out.setdefault(mesh, []).append(i)
    return out


def _is_list(a) -> bool:
    return isinstance(a, (list, tuple))


__all__ = ["ByMeshPlan", "is_foreach", "split"]
