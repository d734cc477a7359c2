"""nll_loss forward and backward (cross_entropy is log_softmax + nll_loss).

    nll_loss_forward(x (N, C) or (C,), target, weight, reduction, ignore_index)
        -> (loss, total_weight)
    nll_loss_backward(dy, x, target, weight, reduction, ignore_index, total_weight) -> dx

Per mesh axis: all Replicate; the batch dim sharded on x and target (the class dim must
be whole); or x Partial with the rest Replicate (the loss is linear in x). With a sharded
batch the local losses are sums over part of the batch:

    reduction="sum"   loss Partial(sum), total_weight Partial(sum)
    reduction="mean"  each rank computes sum(w_i * l_i) / W with W the GLOBAL total
                      weight (one scalar all-reduce per batch axis): loss Partial(sum),
                      total_weight Replicate; exact with uneven shards and ignore_index,
                      where averaging the local means would not be
    reduction="none"  loss Shard(0)

Backward divides by the total_weight it is given, so for "mean" it needs the global W
(Replicate), which is what the forward returns.
"""

from __future__ import annotations

from plait import comm
from plait.tensor.ops.registry import OpCall, Sharding, aten, partial_ops, register
from plait.tensor.placement import Partial, Replicate, Shard
from plait.tensor.spec import DTensorSpec

NONE, MEAN, SUM = 0, 1, 2


def _roles(call: OpCall, names) -> list[str]:
    return [n for n, a in zip(names, call.args) if isinstance(a, DTensorSpec)]


@register(aten.nll_loss_forward.default)
def nll_forward_rule(call: OpCall) -> Sharding:
    roles = _roles(call, ["x", "target", "weight"])
    x = call.specs[0]
    reduction = call.arg(3, "reduction", MEAN)
    R = Replicate()
    options: list = [(tuple(R for _ in roles), (R, R))]
    if x.ndim == 2:
        loss = Shard(0) if reduction == NONE else Partial("sum")
        total = R if reduction != SUM else Partial("sum")
        ins = tuple(Shard(0) if r in ("x", "target") else R for r in roles)
        options.append((ins, (loss, total)))
    for op in partial_ops([x]):
        ins = tuple(Partial(op) if r == "x" else R for r in roles)
        options.append((ins, (Partial(op), R)))
    sharding = call.choose(options)
    batch_axes = [a for a, p in enumerate(sharding.inputs[0]) if p == Shard(0)]
    if reduction != MEAN or not batch_axes:
        return sharding
    groups = [call.mesh.get_group(a) for a in batch_axes]
    ignore_index = call.arg(4, "ignore_index", -100)

    def run(args, kwargs):
        x_local, target, weight = args[0], args[1], args[2] if len(args) > 2 else None
        loss, total = aten.nll_loss_forward.default(x_local, target, weight, SUM, ignore_index)
        total = total.clone()
        for g in groups:
            comm.all_reduce(total, group=g)
        return loss / total, total

    return sharding.with_local_fn(run)


@register(aten.nll_loss_backward.default)
def nll_backward_rule(call: OpCall) -> Sharding:
    roles = _roles(call, ["dy", "x", "target", "weight", "reduction", "ignore", "total"])
    reduction = call.arg(4, "reduction", MEAN)
    x = call.args[1]
    R = Replicate()
    options: list = [(tuple(R for _ in roles), (R,))]
    if x.ndim == 2:
        per = {"x", "target"} | ({"dy"} if reduction == NONE else set())
        ins = tuple(Shard(0) if r in per else (None if r == "total" and reduction != MEAN else R)
                    for r in roles)
        options.append((ins, (Shard(0),)))
    dy = [s for s, r in zip(call.specs, roles) if r == "dy"]
    for op in partial_ops(dy):
        ins = tuple(Partial(op) if r == "dy" else R for r in roles)
        options.append((ins, (Partial(op),)))
    return call.choose(options)


__all__ = ["nll_backward_rule", "nll_forward_rule"]
