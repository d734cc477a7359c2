"""Complex views: view_as_real and view_as_complex.

    view_as_real     (..., n) complex -> (..., n, 2) real    Shard(d) stays Shard(d)
    view_as_complex  (..., n, 2) real -> (..., n) complex    Shard(d), d < last, stays;
                                                             the pair dim is whole
Both are linear: a sum or avg Partial passes. conj, _conj, conj_physical, _neg_view and
their resolves are pointwise (pointwise.py); the DTensor carries its local's lazy conj and
neg bits (dtensor._carry_math_bits), as torch's does.
"""

from __future__ import annotations

from plait.tensor.ops.registry import OpCall, Sharding, aten, register
from plait.tensor.placement import Partial, Replicate, Shard


def _keep(spec, whole: int | None) -> tuple:
    """The spec's placements, a Shard of dim `whole` made Replicate."""
    return tuple(Replicate() if (type(p) is Shard and p.dim == whole) or
                 (isinstance(p, Partial) and not p.is_linear()) or
                 (not isinstance(p, (Shard, Replicate, Partial))) else p
                 for p in spec.placements)


@register(aten.view_as_real.default)
def view_as_real_rule(call: OpCall) -> Sharding:
    ins = _keep(call.specs[0], None)
    return Sharding((ins,), (ins,))


@register(aten.view_as_complex.default)
def view_as_complex_rule(call: OpCall) -> Sharding:
    spec = call.specs[0]
    ins = _keep(spec, spec.ndim - 1)
    return Sharding((ins,), (ins,))


__all__ = ["view_as_complex_rule", "view_as_real_rule"]
