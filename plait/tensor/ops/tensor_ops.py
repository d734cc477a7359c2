"""Slicing and joining: slice, select, split, unbind, cat, stack, index_select; and the
factory-like ops (*_like, new_*).

Cutting or picking along a sharded dim gathers that dim first, except a slice that
keeps the whole dim. Other dims keep their Shard (renumbered when a dim disappears or
appears) and any Partial passes through (they only move values, so they commute with
any elementwise reduction, max and p-norms included). cat/stack shard every
input on the same non-joined dim. A *_like op follows its input, except that Partial
becomes Replicate (a Partial ones_like would sum to n); new_* follows its input when
the size is the input's, else it is Replicate.
"""

from __future__ import annotations

from plait.tensor.ops.registry import OpCall, Sharding, aten, partials, register
from plait.tensor.placement import Partial, Replicate, Shard, like_strides, local_shape_and_offset


def _dim(call: OpCall, index: int, name: str, default: int = 0) -> int:
    d = call.arg(index, name, default)
    nd = max(call.specs[0].ndim, 1)
    return d % nd


def _drop_dim(placements, dim: int, shift: int = -1):
    """Gather `dim`; renumber Shards past it by `shift` (-1: it disappears, 0: it stays)."""
    ins, outs = [], []
    for p in placements:
        if type(p) is Shard and p.dim == dim:
            ins.append(Replicate())
            outs.append(Replicate())
        else:
            ins.append(p)
            outs.append(Shard(p.dim + shift) if type(p) is Shard and p.dim > dim else p)
    return tuple(ins), tuple(outs)


@register(aten.slice.Tensor)
def slice_rule(call: OpCall) -> Sharding:
    spec = call.specs[0]
    dim = _dim(call, 1, "dim")
    start, end, step = call.arg(2, "start"), call.arg(3, "end"), call.arg(4, "step", 1)
    size = spec.shape[dim]
    whole = (start in (None, 0) or start <= -size) and (end is None or end >= size) and step == 1
    if whole:
        return Sharding((None,), (spec.placements,))
    ins, outs = _drop_dim(spec.placements, dim, 0)
    return Sharding((ins,), (outs,))


@register(aten.select.int)
def select_rule(call: OpCall) -> Sharding:
    ins, outs = _drop_dim(call.specs[0].placements, _dim(call, 1, "dim"))
    return Sharding((ins,), (outs,))


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.split.sizes)
def split_rule(call: OpCall) -> Sharding:
    ins, outs = _drop_dim(call.specs[0].placements, _dim(call, 2, "dim"), 0)
    return Sharding((ins,), (outs,) * len(call.outs))


@register(aten.unbind.int)
def unbind_rule(call: OpCall) -> Sharding:
    ins, outs = _drop_dim(call.specs[0].placements, _dim(call, 1, "dim"))
    return Sharding((ins,), (outs,) * len(call.outs))


@register(aten.index_select.default)
def index_select_rule(call: OpCall) -> Sharding:
    dim = _dim(call, 1, "dim")
    specs, nd = call.specs, call.specs[0].ndim
    R = Replicate()
    if len(specs) == 1:  # a 0-dim index: select-like
        ins, outs = _drop_dim(specs[0].placements, dim, 0)
        return Sharding((ins,), (outs,))
    options = [((R, R), (R,))] + [((Shard(d), R), (Shard(d),)) for d in range(nd) if d != dim]
    options += [((p, R), (p,)) for p in partials(specs[:1])]
    return call.choose(options)


@register(aten.cat.default)
def cat_rule(call: OpCall) -> Sharding:
    specs = call.specs
    nd = call.out.dim()
    dim = call.arg(1, "dim", 0) % max(nd, 1)
    R = Replicate()
    k = len(specs)
    options = [((R,) * k, (R,))]
    if all(s.ndim == nd for s in specs):
        options += [((Shard(d),) * k, (Shard(d),)) for d in range(nd) if d != dim]
    options += [((p,) * k, (p,)) for p in partials(specs)]
    return call.choose(options)


@register(aten.stack.default)
def stack_rule(call: OpCall) -> Sharding:
    specs = call.specs
    nd = call.out.dim()
    dim = call.arg(1, "dim", 0) % nd
    R, k = Replicate(), len(specs)
    options = [((R,) * k, (R,))]
    options += [((Shard(d),) * k, (Shard(d if d < dim else d + 1),)) for d in range(nd - 1)]
    options += [((p,) * k, (p,)) for p in partials(specs)]
    return call.choose(options)


@register(aten.slice_backward.default, aten.select_backward.default,
          aten.index_select_backward.default)
def cut_backward_rule(call: OpCall) -> Sharding:
    """The grad of a slice/select/index_select: zeros of the input's size with the grad
    written in. The cut dim comes back whole; other dims keep the grad's Shard (select's
    output had one dim fewer). Linear in the grad: Partial passes."""
    spec, op = call.specs[0], call.op
    dim = call.args[2] % len(call.args[1])
    ins, outs = [], []
    for p in spec.placements:
        if type(p) is Shard:
            d = p.dim + (1 if op is aten.select_backward.default and p.dim >= dim else 0)
            keep = d != dim
            ins.append(p if keep else Replicate())
            outs.append(Shard(d) if keep else Replicate())
        else:
            ins.append(p)
            outs.append(p)
    mesh = call.mesh
    local = list(local_shape_and_offset(tuple(call.args[1]), outs, mesh.shape, mesh.get_coordinate())[0])
    index = tuple(Replicate() for _ in spec.placements)  # index_select's index
    return Sharding((tuple(ins),) + (index,) * (len(call.specs) - 1), (tuple(outs),),
                    lambda args, kwargs: op(args[0], local, *args[2:], **kwargs))


def _like(placements):
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


@register(aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
          aten.full_like.default)
def like_rule(call: OpCall) -> Sharding:
    return Sharding((None,), (_like(call.specs[0].placements),))


@register(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
          aten.new_full.default, aten.new_empty_strided.default)
def new_rule(call: OpCall) -> Sharding:
    spec = call.specs[0]
    size = tuple(call.args[1])
    if size != tuple(spec.shape) or not spec.sharded_dims():
        return Sharding((None,), (tuple(Replicate() for _ in spec.placements),))
    local = list(spec.local_shape)
    op = call.op
    if op is aten.new_empty_strided.default:
        stride = list(like_strides(local, call.args[2]))
        return Sharding((None,), (_like(spec.placements),),
                        lambda args, kwargs: op(args[0], local, stride, *args[3:], **kwargs))
    return Sharding((None,), (_like(spec.placements),),
                    lambda args, kwargs: op(args[0], local, *args[2:], **kwargs))


__all__ = ["cat_rule", "like_rule", "new_rule", "slice_rule"]
