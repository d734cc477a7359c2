"""Matrix products: mm, addmm, bmm, baddbmm, dot, mv (linear and matmul decompose to
these plus views), as einsum equations.

For one mesh axis and an equation like "mk,kn->mn", each letter gives a strategy:

    batch (in both inputs and the output)   Shard both on it      -> Shard the output
    contracted (in both, not the output)    Shard both on it      -> Partial(sum)
    free in one input (and the output)      Shard it, other R     -> Shard the output
    plus all Replicate, and one input Partial with the other Replicate -> Partial

addmm/baddbmm's bias follows the output: Shard where it has the output's dim at full
size, Partial (kept on one rank, zeros elsewhere) when the output is Partial.
"""

from __future__ import annotations

from plait.tensor.ops.registry import OpCall, Sharding, aten, partial_ops, register
from plait.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard
from plait.tensor.spec import DTensorSpec


def einsum_strategies(equation: str, specs: list[DTensorSpec]) -> list:
    """Strategies for the two operands of `equation` ("ab,bc->ac")."""
    inputs, out = equation.split("->")
    lhs, rhs = inputs.split(",")
    R = Replicate()
    options: list = [((R, R), (R,))]
    for c in dict.fromkeys(lhs + rhs):
        in_l, in_r, in_o = c in lhs, c in rhs, c in out
        left = Shard(lhs.index(c)) if in_l else R
        right = Shard(rhs.index(c)) if in_r else R
        if in_o:
            options.append(((left, right), (Shard(out.index(c)),)))
        elif in_l and in_r:
            options.append(((left, right), (Partial("sum"),)))
    # a batch dim that a reshape left block-strided (a 4-D matmul's heads): kept as it is
    for c in dict.fromkeys(lhs):
        if c in rhs and c in out:
            for sf in {p.split_factor for s, i in zip(specs, (lhs, rhs)) for p in s.placements
                       if type(p) is _StridedShard and p.dim == i.index(c)}:
                options.append(((_StridedShard(lhs.index(c), split_factor=sf),
                                 _StridedShard(rhs.index(c), split_factor=sf)),
                                (_StridedShard(out.index(c), split_factor=sf),)))
    for op in partial_ops(specs) or ():
        p = Partial(op)
        options.append(((p, R), (p,)))
        options.append(((R, p), (p,)))
    return options


def with_bias(options: list, bias: DTensorSpec, out_ndim: int, out_shape) -> list:
    """Prepend the bias's placement (broadcast against the output) to each strategy."""
    result = []
    for (left, right), (o,) in options:
        result.append(((_bias_placement(o, bias, out_ndim, out_shape), left, right), (o,)))
    return result


def _bias_placement(o: Placement, bias: DTensorSpec, out_ndim: int, out_shape) -> Placement:
    if type(o) is Shard:
        d = o.dim - (out_ndim - bias.ndim)
        return Shard(d) if d >= 0 and bias.shape[d] == out_shape[o.dim] else Replicate()
    return o  # Replicate, or Partial: the bias is added once across the ranks


def _einsum_rule(equation: str, biased: bool):
    def rule(call: OpCall) -> Sharding:
        specs = call.specs
        if biased and len(specs) == 3:
            options = einsum_strategies(equation, specs[1:])
            return call.choose(with_bias(options, specs[0], call.out.dim(), call.out.shape))
        options = einsum_strategies(equation, specs[-2:])
        if biased:  # a plain 0-dim bias is added on every rank: no Partial output
            options = [(ins, outs) for ins, outs in options if not isinstance(outs[0], Partial)]
        return call.choose(options)

    return rule


register(aten.mm.default)(_einsum_rule("mk,kn->mn", False))
bmm_rule = register(aten.bmm.default)(_einsum_rule("bmk,bkn->bmn", False))
register(aten.dot.default)(_einsum_rule("k,k->", False))
register(aten.mv.default)(_einsum_rule("mk,k->m", False))
register(aten.addmm.default, aten.addmm_.default)(_einsum_rule("mk,kn->mn", True))
register(aten.baddbmm.default, aten.baddbmm_.default)(_einsum_rule("bmk,bkn->bmn", True))

__all__ = ["bmm_rule", "einsum_strategies", "with_bias"]
