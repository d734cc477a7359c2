"""softmax and log_softmax, forward and backward.

The softmax dim must be whole on every rank (a sharded one is gathered); any other dim
may be sharded, the same way on every tensor of the call. Forward is not linear, so a
Partial input is reduced first. Backward is linear in the incoming gradient: a Partial
grad with a Replicate output gives a Partial input grad, no communication.
"""

from __future__ import annotations

from plait.tensor.ops.registry import OpCall, Sharding, aten, partial_ops, register
from plait.tensor.placement import Partial, Replicate, Shard


def _strategies(call: OpCall, dim: int, linear_first: bool) -> list:
    specs = call.specs
    nd, k = specs[0].ndim, len(specs)
    R = Replicate()
    options = [((R,) * k, (R,))]
    options += [((Shard(d),) * k, (Shard(d),)) for d in range(nd) if d != dim]
    if linear_first:
        for op in partial_ops(specs[:1]):
            options.append(((Partial(op),) + (R,) * (k - 1), (Partial(op),)))
    return options


@register(aten._softmax.default, aten._log_softmax.default)
def softmax_rule(call: OpCall) -> Sharding:
    dim = call.args[1] % max(call.specs[0].ndim, 1)
    return call.choose(_strategies(call, dim, linear_first=False))


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward_rule(call: OpCall) -> Sharding:
    dim = call.args[2] % max(call.specs[0].ndim, 1)
    return call.choose(_strategies(call, dim, linear_first=True))


__all__ = ["softmax_backward_rule", "softmax_rule"]
