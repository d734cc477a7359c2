"""layer_norm and RMS norm, forward and backward.

    native_layer_norm(x, normalized_shape, w, b, eps)     -> (y, mean, rstd)
    native_layer_norm_backward(dy, x, shape, mean, rstd, w, b, mask) -> (dx, dw, db)
    _fused_rms_norm(x, normalized_shape, w, eps)          -> (y, rstd)
    _fused_rms_norm_backward(dy, x, shape, rstd, w, mask) -> (dx, dw)

The normalized (trailing) dims must be whole; a batch dim may be sharded (sequence
parallel shards dim 1), with mean/rstd sharded alike and the weight and bias whole.
Sharding a batch dim makes dw and db sums over part of the batch: Partial. Backward is
linear in dy, so a Partial dy gives Partial grads. RMS norm that decomposes into
pointwise ops and mean (torch on CPU) needs no rule of its own.
"""

from __future__ import annotations

from plait.tensor.ops.registry import OpCall, Sharding, aten, partial_ops, register
from plait.tensor.placement import Partial, Replicate, Shard
from plait.tensor.spec import DTensorSpec


def _batch_dims(call: OpCall, x_pos: int) -> int:
    """Leading dims of x that are not normalized (the shape arg follows x)."""
    return call.args[x_pos].ndim - len(call.args[x_pos + 1])


def _roles(call: OpCall, names: list[str]) -> list[str]:
    """The role of each DTensor arg, in the order of call.specs."""
    roles = []
    for name, a in zip(names, call.args):
        if isinstance(a, DTensorSpec):
            roles.append(name)
    return roles


@register(aten.native_layer_norm.default, aten._fused_rms_norm.default)
def norm_forward(call: OpCall) -> Sharding:
    names = ["x", "shape", "w", "b", "eps"] if call.op is aten.native_layer_norm.default \
        else ["x", "shape", "w", "eps"]
    roles = _roles(call, names)
    n_out = len(call.outs)
    R = Replicate()
    options = [((R,) * len(roles), (R,) * n_out)]
    for d in range(_batch_dims(call, 0)):
        ins = tuple(Shard(d) if r == "x" else R for r in roles)
        options.append((ins, (Shard(d),) * n_out))
    return call.choose(options)


@register(aten.native_layer_norm_backward.default, aten._fused_rms_norm_backward.default)
def norm_backward(call: OpCall) -> Sharding:
    if call.op is aten.native_layer_norm_backward.default:
        names = ["dy", "x", "shape", "mean", "rstd", "w", "b", "mask"]
    else:
        names = ["dy", "x", "shape", "rstd", "w", "mask"]
    roles = _roles(call, names)
    n_out = len(call.outs)  # dx, then parameter grads (None where the mask says so)
    R = Replicate()
    per_sample = {"dy", "x", "mean", "rstd"}
    options = [((R,) * len(roles), (R,) * n_out)]
    for d in range(_batch_dims(call, 1)):
        ins = tuple(Shard(d) if r in per_sample else R for r in roles)
        options.append((ins, (Shard(d),) + (Partial("sum"),) * (n_out - 1)))
    for op in partial_ops([s for s, r in zip(call.specs, roles) if r == "dy"]):
        ins = tuple(Partial(op) if r == "dy" else R for r in roles)
        options.append((ins, (Partial(op),) * n_out))
    return call.choose(options)


__all__ = ["norm_backward", "norm_forward"]
