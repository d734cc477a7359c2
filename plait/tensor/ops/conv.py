"""Convolutions: aten.convolution and its backward, data parallel over the batch.

    forward   input Shard(0), weight and bias Replicate        -> output Shard(0)
    backward  grad_output and input Shard(0), weight Replicate  -> grad_input Shard(0),
                                                                   grad_weight, grad_bias Partial(sum)

(each rank convolves its own images; the weight's gradient is the sum over all of them).
Anything else is Replicate. Channel or spatial sharding (halo exchange) is not done:
TODO(rule) when a model asks for it.
"""

from __future__ import annotations

from plait.tensor.ops.registry import OpCall, Sharding, aten, register
from plait.tensor.placement import Partial, Replicate, Shard


@register(aten.convolution.default)
def convolution_rule(call: OpCall) -> Sharding:
    R = Replicate()
    n = len(call.specs)
    strategies = [((R,) * n, (R,))]
    if call.specs[0].shape[0] > 1:
        strategies.append(((Shard(0),) + (R,) * (n - 1), (Shard(0),)))
    return call.choose(strategies)


@register(aten.convolution_backward.default)
def convolution_backward_rule(call: OpCall) -> Sharding:
    R = Replicate()
    n, n_out = len(call.specs), len(call.outs or ())
    strategies = [((R,) * n, (R,) * n_out)]
    grad_output, input_ = call.specs[0], call.specs[1]
    if input_.shape[0] > 1 and grad_output.shape[0] == input_.shape[0]:
        outs = (Shard(0),) + (Partial("sum"),) * (n_out - 1)
        strategies.append(((Shard(0), Shard(0)) + (R,) * (n - 2), outs))
    return call.choose(strategies)


__all__ = ["convolution_backward_rule", "convolution_rule"]
