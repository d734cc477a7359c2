"""View ops: view/_unsafe_view (what reshape, flatten, unflatten become), squeeze,
unsqueeze, expand, t, transpose, permute.

A reshape pairs runs of input dims with runs of output dims of equal product (size-1
dims on their own). A Shard on input dim d survives as a Shard on its run's first output
dim when d leads its run and both sides cut the run at the same elements:

    chunk(in_size, n) * inner_in == chunk(out_size, n) * inner_out     (elementwise)

(8,4)->(32) on 2 ranks: [4,4]*4 == [16,16], Shard(0) stays; (7,4)->(28) on 4 ranks:
[2,2,2,1]*4 != [7,7,7,7], so dim 0 is gathered first. A dim cut by several mesh axes
keeps its inner axes only when its run is unchanged. Partial passes through (views are
linear). Locally the op runs with this rank's output shape. In-place view ops (t_,
squeeze_, ...) change a tensor's shape under its feet and have no rule.
"""

from __future__ import annotations

from plait.tensor.ops.registry import OpCall, Sharding, aten, register
from plait.tensor.placement import (
    Replicate,
    Shard,
    _StridedShard,
    chunk_sizes,
    local_shape_and_offset,
)


def view_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """Runs of input dims and output dims with equal products (numel > 0)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    ni, no = len(in_shape), len(out_shape)
    while i < ni or j < no:
        if i < ni and in_shape[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < no and out_shape[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        gi, gj, pi, pj = [i], [j], in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            else:
                gj.append(j)
                pj *= out_shape[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _prod(xs) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def reshape_placements(call: OpCall, in_shape, out_shape):
    """(input placements, output placements) for a reshape of the first spec."""
    spec = call.specs[0]
    mesh_shape = spec.mesh.shape
    ins, outs = list(spec.placements), list(spec.placements)
    if _prod(in_shape) == 0:
        groups, owner = [], {}
    else:
        groups = view_groups(in_shape, out_shape)
        owner = {d: g for g in groups for d in g[0]}
    seen: set[int] = set()
    # a dim a _StridedShard cuts keeps its cuts only where it passes through unchanged;
    # otherwise the planner gathers the strided axis first (a half-kept pair is no layout)
    strided = {p.dim for p in spec.placements if type(p) is _StridedShard}
    for axis, p in enumerate(spec.placements):
        if type(p) is not Shard and type(p) is not _StridedShard:
            continue
        d = p.dim
        group = owner.get(d)
        n = mesh_shape[axis]
        run = set(group[0]) if group else {d}  # no other axis may cut any dim of d's run
        alone = sum(1 for q in spec.placements if isinstance(q, (Shard, _StridedShard)) and q.dim in run) == 1
        target = _target(group, d, in_shape, out_shape, n, nested=d in seen or d in strided)
        seen.add(d)
        if target is None and alone and type(p) is Shard:
            folded = _fold(group, d, in_shape, out_shape, n)  # (b, h/n) -> (b*h, strided)
            if folded is not None:
                ins[axis], outs[axis] = p, _StridedShard(folded[0], split_factor=folded[1])
                continue
        if target is None and alone and type(p) is _StridedShard:
            unfolded = _unfold(group, p, in_shape, out_shape, n)  # (b*h, strided) -> (b, h/n)
            if unfolded is not None:
                ins[axis], outs[axis] = p, Shard(unfolded)
                continue
        if target is None:
            ins[axis] = outs[axis] = Replicate()
        else:
            outs[axis] = Shard(target) if type(p) is Shard else _StridedShard(target, split_factor=p.split_factor)
    return tuple(ins), tuple(outs)


def _fold(group, d: int, in_shape, out_shape, n: int) -> tuple[int, int] | None:
    """Flattening dims (.., d, ..) into one dim where Shard(d) is not the first: the
    output dim is cut in blocks of the dims before d, each block sharded as d is
    (torch's _StridedShard(e, split_factor=blocks), what a 4-D matmul's reshape to
    3-D makes of sharded heads). (output dim, split factor), or None."""
    if group is None:
        return None
    gi, gj = group
    lead_out = [k for k in gj if out_shape[k] != 1]
    if len(lead_out) != 1 or d not in gi:
        return None
    blocks = _prod(in_shape[k] for k in gi if k < d)
    inner = _prod(in_shape[k] for k in gi if k > d)
    block = in_shape[d] * inner
    if blocks == 1 or [c * inner for c in chunk_sizes(in_shape[d], n)] != chunk_sizes(block, n):
        return None
    return lead_out[0], blocks


def _unfold(group, p: _StridedShard, in_shape, out_shape, n: int) -> int | None:
    """The inverse of _fold: a dim cut in `split_factor` blocks, each sharded, viewed as
    (blocks, d, ..) is Shard(d). The output dim, or None."""
    if group is None:
        return None
    gi, gj = group
    lead_in = [k for k in gi if in_shape[k] != 1]
    if lead_in != [p.dim]:
        return None
    before = 1
    for k in gj:
        if before == p.split_factor and out_shape[k] != 1:
            inner = _prod(out_shape[j] for j in gj if j > k)
            block = in_shape[p.dim] // p.split_factor
            if [c * inner for c in chunk_sizes(out_shape[k], n)] == chunk_sizes(block, n):
                return k
            return None
        before *= out_shape[k]
    return None


def _target(group, d: int, in_shape, out_shape, n: int, nested: bool) -> int | None:
    if group is None:
        return None
    gi, gj = group
    lead_in = [k for k in gi if in_shape[k] != 1]
    lead_out = [k for k in gj if out_shape[k] != 1]
    if not lead_in or lead_in[0] != d or not lead_out:
        return None
    e = lead_out[0]
    inner_in = _prod(in_shape[k] for k in gi if k > d)
    inner_out = _prod(out_shape[k] for k in gj if k > e)
    if in_shape[d] == out_shape[e] and inner_in == inner_out:
        return e  # the dim passes through unchanged
    if nested:
        return None
    cut_in = [c * inner_in for c in chunk_sizes(in_shape[d], n)]
    cut_out = [c * inner_out for c in chunk_sizes(out_shape[e], n)]
    return e if cut_in == cut_out else None


def _local_shape(call: OpCall, placements) -> tuple[int, ...]:
    mesh = call.mesh
    return local_shape_and_offset(tuple(call.out.shape), placements, mesh.shape, mesh.get_coordinate())[0]


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default)
def reshape_rule(call: OpCall) -> Sharding:
    ins, outs = reshape_placements(call, tuple(call.specs[0].shape), tuple(call.out.shape))
    local = list(_local_shape(call, outs))
    op = call.op

    def run(args, kwargs):
        x = args[0]
        try:
            return op(x, local) if op is not aten._reshape_alias.default else x.view(local)
        except RuntimeError:  # the local piece's strides do not allow a view
            return aten._unsafe_view(x.reshape(local), local)

    return Sharding((ins,), (outs,), run)


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default)
def squeeze_rule(call: OpCall) -> Sharding:
    ins, outs = reshape_placements(call, tuple(call.specs[0].shape), tuple(call.out.shape))
    if call.op is aten.unsqueeze.default:
        return Sharding((ins,), (outs,))  # local unsqueeze(dim) is exact
    local = list(_local_shape(call, outs))
    # a local piece may have size 1 where the global dim does not: squeeze by shape
    return Sharding((ins,), (outs,), lambda args, kwargs: args[0].view(local))


@register(aten.expand.default)
def expand_rule(call: OpCall) -> Sharding:
    spec, out = call.specs[0], call.out
    off = out.dim() - spec.ndim
    ins, outs = list(spec.placements), list(spec.placements)
    for axis, p in enumerate(spec.placements):
        if type(p) is Shard:
            if spec.shape[p.dim] == out.shape[p.dim + off]:
                outs[axis] = Shard(p.dim + off)
            else:
                ins[axis] = outs[axis] = Replicate()
    local = list(_local_shape(call, tuple(outs)))
    return Sharding((tuple(ins),), (tuple(outs),), lambda args, kwargs: aten.expand.default(args[0], local))


def _permuted(call: OpCall, perm) -> Sharding:
    """Output dim k is input dim perm[k]."""
    spec = call.specs[0]
    where = {d: k for k, d in enumerate(perm)}
    outs = tuple(Shard(where[p.dim]) if type(p) is Shard else
                 _StridedShard(where[p.dim], split_factor=p.split_factor) if type(p) is _StridedShard else p
                 for p in spec.placements)  # a strided piece is a block too: its dims move with it
    return Sharding((None,), (outs,))


@register(aten.t.default)
def t_rule(call: OpCall) -> Sharding:
    return _permuted(call, [1, 0] if call.specs[0].ndim == 2 else list(range(call.specs[0].ndim)))


@register(aten.transpose.int)
def transpose_rule(call: OpCall) -> Sharding:
    nd = call.specs[0].ndim
    a, b = (d % max(nd, 1) for d in (call.args[1], call.args[2]))
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return _permuted(call, perm)


@register(aten.permute.default)
def permute_rule(call: OpCall) -> Sharding:
    nd = call.specs[0].ndim
    return _permuted(call, [d % nd for d in call.args[1]])


__all__ = ["permute_rule", "reshape_placements", "reshape_rule", "squeeze_rule", "t_rule", "transpose_rule",
           "view_groups"]
