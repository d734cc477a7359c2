"""Reductions: sum, mean, amax, amin, max, min, var, std, argmax/argmin, vector_norm,
_foreach_norm.

Per mesh axis, from the input's placement:

    Shard on a reduced dim      sum, mean -> Partial(sum)   amax, max -> Partial(max)
                                amin, min -> Partial(min)   vector_norm(p) -> p-norm partial
                                var, std, max.dim, argmax -> gather the dim first
    Shard on a kept dim         Shard, renumbered past the dims that disappear
    Partial                     sum/mean keep a linear Partial; amax keeps Partial(max),
                                amin Partial(min), a norm its own p-norm partial; else gather

mean over a sharded dim runs locally as sum / (the global count), so uneven shards give
the exact mean (the average of local means would not). A rank whose piece of a reduced
dim is empty returns the reduction's identity (-inf for max, 0 for a norm) instead of
the error torch raises for an empty max.
"""

from __future__ import annotations

import math

import torch

from plait.tensor.ops.foreach import split_by_index
from plait.tensor.ops.registry import OpCall, Sharding, aten, register
from plait.tensor.placement import (
    Partial,
    Replicate,
    Shard,
    _NormPartial,
    _StridedShard,
    local_shape_and_offset,
)

# op -> (kind, position of the dims arg or None for "all dims", position of keepdim)
KINDS = {
    aten.sum.default: ("sum", None, None), aten.sum.dim_IntList: ("sum", 1, 2),
    aten.mean.default: ("mean", None, None), aten.mean.dim: ("mean", 1, 2),
    aten.amax.default: ("max", 1, 2), aten.amin.default: ("min", 1, 2),
    aten.max.default: ("max", None, None), aten.min.default: ("min", None, None),
    aten.max.dim: ("gather", 1, 2), aten.min.dim: ("gather", 1, 2),
    aten.argmax.default: ("gather", 1, 2), aten.argmin.default: ("gather", 1, 2),
    aten.var.correction: ("gather", 1, "keepdim"), aten.std.correction: ("gather", 1, "keepdim"),
    aten.linalg_vector_norm.default: ("norm", 2, 3),
}
_IDENTITY = {"max": -math.inf, "min": math.inf}


def reduced_dims(call: OpCall, pos, ndim: int) -> list[int]:
    dims = None if pos is None else call.arg(pos, "dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % max(ndim, 1) for d in dims)


def _keepdim(call: OpCall, pos) -> bool:
    if pos is None:
        return False
    if isinstance(pos, str):
        return bool(call.kwargs.get(pos, False))
    return bool(call.arg(pos, "keepdim", False))


def _partial_of(kind: str, call: OpCall) -> Partial | None:
    if kind in ("sum", "mean"):
        return Partial("sum")
    if kind in ("max", "min"):
        return Partial(kind)
    if kind == "norm":
        return _NormPartial(float(call.arg(1, "ord", 2)))
    return None


def _keeps(kind: str, p: Partial, reduced: Partial | None) -> bool:
    """Whether a Partial input stays Partial through the reduction."""
    if kind in ("sum", "mean"):
        return p.is_linear()
    return reduced is not None and p == reduced


def reduce_placements(kind: str, call: OpCall, spec, dims: list[int], keepdim: bool):
    reduced = _partial_of(kind, call)
    ins, outs, partial_axes = [], [], []
    for axis, p in enumerate(spec.placements):
        if type(p) is Shard or type(p) is _StridedShard:  # a strided piece is a block too
            if p.dim not in dims:
                shift = 0 if keepdim else sum(d < p.dim for d in dims)
                ins.append(p)
                outs.append(Shard(p.dim - shift) if type(p) is Shard
                            else _StridedShard(p.dim - shift, split_factor=p.split_factor))
            elif reduced is None:
                ins.append(Replicate())
                outs.append(Replicate())
            else:
                ins.append(p)
                outs.append(reduced)
                partial_axes.append(axis)
        elif isinstance(p, Partial) and not _keeps(kind, p, reduced):
            ins.append(Replicate())
            outs.append(Replicate())
        else:
            ins.append(p)
            outs.append(p)
    return tuple(ins), tuple(outs), partial_axes


def reduction_rule(call: OpCall) -> Sharding:
    kind, dims_pos, keep_pos = KINDS[call.op]
    spec = call.specs[0]
    dims = reduced_dims(call, dims_pos, spec.ndim)
    ins, outs, partial_axes = reduce_placements(kind, call, spec, dims, _keepdim(call, keep_pos))
    n_out = len(call.outs)
    local_fn = None
    if partial_axes and kind == "mean":
        count = math.prod(spec.shape[d] for d in dims)
        local_fn = _mean_as_sum(dims, _keepdim(call, keep_pos), count, call.out.dtype)
    elif partial_axes and kind in ("max", "min", "norm"):
        local_fn = _guard_empty(call, dims, outs, kind)
    return Sharding((ins,), (outs,) * n_out, local_fn)


def _mean_as_sum(dims, keepdim: bool, count: int, dtype: torch.dtype):
    acc = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype

    def run(args, kwargs):
        return (args[0].sum(dims, keepdim=keepdim, dtype=acc) / count).to(dtype)

    return run


def _guard_empty(call: OpCall, dims, outs, kind: str):
    op = call.op
    mesh = call.mesh
    local_out = local_shape_and_offset(tuple(call.out.shape), outs, mesh.shape, mesh.get_coordinate())[0]
    dtype = call.out.dtype
    if kind == "norm":
        ord_ = float(call.arg(1, "ord", 2))
        identity = math.inf if ord_ == -math.inf else 0.0
    else:
        identity = _IDENTITY[kind]

    def run(args, kwargs):
        x = args[0]
        if any(x.shape[d] == 0 for d in dims) if x.dim() else False:
            fill = identity
            if not dtype.is_floating_point and math.isinf(fill):
                info = torch.iinfo(dtype)
                fill = info.min if fill < 0 else info.max
            return torch.full(local_out, fill, dtype=dtype, device=x.device)
        return op(*args, **kwargs)

    return run


register(*KINDS)(reduction_rule)


@register(aten._foreach_norm.Scalar)
def foreach_norm_rule(call: OpCall) -> Sharding:
    indices, _ = split_by_index(call)
    ord_ = float(call.arg(1, "ord", 2))
    reduced = _NormPartial(ord_)
    inputs, outputs = [], []
    for ix in indices:
        spec = ix.specs[0]
        ins, outs = [], []
        for p in spec.placements:
            if type(p) is Shard or type(p) is _StridedShard or p == reduced:
                ins.append(p)
                outs.append(reduced)
            elif isinstance(p, Partial):
                ins.append(Replicate())
                outs.append(Replicate())
            else:
                ins.append(p)
                outs.append(p)
        inputs.append(tuple(ins))
        outputs.append(tuple(outs))
    identity = math.inf if ord_ == -math.inf else 0.0
    op = call.op

    def run(args, kwargs):
        tensors = args[0]
        if all(t.numel() for t in tensors) or ord_ not in (math.inf, -math.inf):
            return op(*args, **kwargs)
        return [torch.linalg.vector_norm(t, ord_) if t.numel() else
                torch.full((), identity, dtype=t.dtype, device=t.device) for t in tensors]

    return Sharding(tuple(inputs), tuple(outputs), run)


__all__ = ["KINDS", "reduce_placements", "reduction_rule"]
