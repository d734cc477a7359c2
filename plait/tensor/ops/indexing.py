"""Advanced indexing: aten.index.Tensor, what `x[idx]`, `x[:, idx]` and `x[mask_idx]` become.

    index(self, [i0, None, i2, ...])    k index tensors, broadcast to shape B (|B| dims)

The output is self's dims that no index touches, with the |B| index dims in place of the
indexed ones when those are adjacent, else first:

    self (s0, s1, s2), index on dim 1 (B = (n,))    -> (s0, n, s2)
    self (s0, s1, s2), index on dims 0 and 2         -> (n, s1)

Per mesh axis the strategies are: all Replicate; self Shard(d) on a dim no index touches,
the indices Replicate -> Shard at d's place in the output; self Replicate and one index
tensor Shard(k) (alone, or every index tensor of one shape sharded alike) -> Shard at
that index dim's place; and, indexing being linear, a sum or avg Partial self with
Replicate indices -> the same Partial.
"""

from __future__ import annotations

from plait.tensor.ops.registry import NoStrategy, OpCall, Sharding, aten, register
from plait.tensor.placement import Partial, Replicate, Shard
from plait.tensor.spec import DTensorSpec


@register(aten.index.Tensor)
def index_rule(call: OpCall) -> Sharding:
    if call.outs is None:
        raise NoStrategy  # a boolean mask's count of True: the output's size is data
    self_spec = call.specs[0]
    indices = call.args[1]
    nd = self_spec.ndim
    touched = [d for d, t in enumerate(indices) if t is not None]
    idx_specs = [t for t in indices if isinstance(t, DTensorSpec)]
    out_nd = call.out.dim()
    b = out_nd - (nd - len(touched))  # dims of the broadcast index shape
    adjacent = touched == list(range(touched[0], touched[-1] + 1)) if touched else True
    first = touched[0] if adjacent and touched else 0

    def place(d: int) -> int:  # an untouched self dim -> its output dim
        before = sum(1 for t in touched if t < d)
        if adjacent:
            return d if d < first else d - len(touched) + b
        return b + d - before

    R = Replicate()
    n_idx = len(idx_specs)
    strategies = [((R,) * (1 + n_idx), (R,))]
    for d in range(nd):
        if d not in touched and self_spec.shape[d] > 1:
            strategies.append(((Shard(d),) + (R,) * n_idx, (Shard(place(d)),)))
    shapes = {tuple(s.shape) for s in idx_specs}
    if idx_specs and len(shapes) == 1 and len(idx_specs) == len(touched):
        k_nd = idx_specs[0].ndim
        for k in range(k_nd):
            od = (first if adjacent else 0) + (b - k_nd) + k
            strategies.append(((R,) + (Shard(k),) * n_idx, (Shard(od),)))
    for p in {p for p in self_spec.placements if type(p) is Partial and p.is_linear()}:
        strategies.append(((p,) + (R,) * n_idx, (p,)))
    return call.choose(strategies)


__all__ = ["index_rule"]
