"""embedding forward and backward, including a vocabulary-sharded weight.

    embedding(weight, indices)            per mesh axis:
        weight R,     indices Shard(d)    -> Shard(d)
        weight S(1),  indices R           -> Shard(last)     (embedding dim sharded)
        weight S(0),  indices R           -> Partial(sum)    (vocabulary sharded: masked
                                                              lookup, zero rows outside)
        weight P,     indices R           -> P               (linear in the weight)
    embedding_dense_backward(grad, indices, num_weights, ...)  (torch's strategies)
        grad R, indices R -> R;  grad S(last) -> S(1);  grad S(d), indices S(d) -> P
        (not with scale_grad_by_freq, whose counts need every index);  grad P -> P

The masked lookup shifts indices by this rank's first row, looks up the rows it owns
and zeroes the others; a rank owning no rows returns zeros.
"""

from __future__ import annotations

from plait.tensor.ops.registry import OpCall, Sharding, aten, partial_ops, register
from plait.tensor.placement import Partial, Replicate, Shard


@register(aten.embedding.default)
def embedding_rule(call: OpCall) -> Sharding:
    weight, indices = call.specs
    R = Replicate()
    out_nd = call.out.dim()
    options = [((R, R), (R,))]
    options += [((R, Shard(d)), (Shard(d),)) for d in range(indices.ndim)]
    options.append(((Shard(1), R), (Shard(out_nd - 1),)))
    options.append(((Shard(0), R), (Partial("sum"),)))
    options += [((Partial(op), R), (Partial(op),)) for op in partial_ops([weight])]
    sharding = call.choose(options)
    vocab_axes = [a for a, p in enumerate(sharding.inputs[0]) if p == Shard(0)]
    if not vocab_axes:
        return sharding
    # the weight's local rows: after the vocabulary axes (and any other Shard(0)) cut dim 0
    w_spec = weight.with_placements(sharding.inputs[0])
    lo, rows = w_spec.local_offset[0], w_spec.local_shape[0]
    padding_idx = call.arg(2, "padding_idx", -1)
    return sharding.with_local_fn(_masked_lookup(lo, rows, padding_idx, w_spec.local_shape[1:]))


def _masked_lookup(lo: int, rows: int, padding_idx: int, row_shape):
    def run(args, kwargs):
        weight, indices = args[0], args[1]
        if rows == 0:
            return weight.new_zeros((*indices.shape, *row_shape))
        outside = (indices < lo) | (indices >= lo + rows)
        local_idx = (indices - lo).masked_fill_(outside, 0)
        local_pad = padding_idx - lo if lo <= padding_idx < lo + rows else -1
        out = aten.embedding.default(weight, local_idx, local_pad, *args[3:], **kwargs)
        return out.masked_fill_(outside.unsqueeze(-1), 0)

    return run


@register(aten.embedding_dense_backward.default)
def embedding_backward_rule(call: OpCall) -> Sharding:
    grad, indices = call.specs
    scale_by_freq = bool(call.arg(4, "scale_grad_by_freq", False))
    R = Replicate()
    options = [((R, R), (R,)), ((Shard(grad.ndim - 1), R), (Shard(1),))]
    if not scale_by_freq:
        options += [((Shard(d), Shard(d)), (Partial("sum"),)) for d in range(indices.ndim)]
    options += [((Partial(op), R), (Partial(op),)) for op in partial_ops([grad])]
    return call.choose(options)


__all__ = ["embedding_backward_rule", "embedding_rule"]
