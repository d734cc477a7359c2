"""`_foreach_*` ops (what torch's SGD, Adam, AdamW and clip_grad_norm_ call with foreach).

A foreach op is the pointwise op of its family applied index by index across its tensor
lists: element i of every list (and any single tensor arg, e.g. a 0-dim scale) form one
pointwise call, whose strategy is chosen exactly as `pointwise` would. A single DTensor
shared by every index (a clip coefficient) is moved to Replicate once, so the indices
cannot disagree about it. The local run is still one foreach call over the local lists.
"""

from __future__ import annotations

from plait.tensor.ops import pointwise
from plait.tensor.ops.registry import FLOAT_VALUE_FREE, OpCall, Sharding, aten, choose, register
from plait.tensor.placement import Replicate
from plait.tensor.spec import DTensorSpec

FAMILIES = """add sub mul div lerp addcmul addcdiv sqrt rsqrt neg abs exp log log1p expm1 reciprocal
sign pow maximum minimum clamp_min clamp_max zero copy sigmoid tanh sin cos erf floor ceil round
trunc frac acos asin atan cosh sinh tan erfc lgamma log10 log2 clone""".split()


def foreach_ops() -> list:
    ops = []
    for family in FAMILIES:
        for name in (f"_foreach_{family}", f"_foreach_{family}_"):
            packet = getattr(aten, name, None)
            if packet is None:
                continue
            ops += [getattr(packet, o) for o in packet.overloads() if "out" not in o]
    return ops


class _Index:
    """One index of a foreach call, seen as a pointwise call."""

    __slots__ = ("spec_index", "specs", "flat")

    def __init__(self) -> None:
        self.spec_index: dict[int, int] = {}  # arg position -> index into self.specs
        self.specs: list[DTensorSpec] = []
        self.flat: list[int] = []  # index into call.specs of each of self.specs


def split_by_index(call: OpCall) -> tuple[list[_Index], list[int]]:
    """Per list index, the pointwise view of the call; and the flat indices of DTensors
    shared by every index."""
    lists = [a for a in call.args if isinstance(a, (list, tuple))]
    n = len(lists[0]) if lists else 0
    indices = [_Index() for _ in range(n)]
    shared: list[int] = []
    k = 0
    for pos, a in enumerate(call.args):
        if isinstance(a, (list, tuple)):
            for i, e in enumerate(a):
                if isinstance(e, DTensorSpec):
                    ix = indices[i]
                    ix.spec_index[pos] = len(ix.specs)
                    ix.specs.append(e)
                    ix.flat.append(k)
                    k += 1
        elif isinstance(a, DTensorSpec):
            shared.append(k)
            for ix in indices:
                ix.spec_index[pos] = len(ix.specs)
                ix.specs.append(a.with_placements(tuple(Replicate() for _ in a.placements)))
                ix.flat.append(k)
            k += 1
    return indices, shared


def foreach_rule(call: OpCall) -> Sharding:
    name = pointwise.base_name(call.op).removeprefix("_foreach_")
    overload = call.op._overloadname
    indices, shared = split_by_index(call)
    inputs: list = [None] * len(call.specs)
    outputs: list = []
    replicate = tuple(Replicate() for _ in range(call.mesh.ndim))
    for k in shared:
        inputs[k] = replicate
    for ix in indices:
        mutated = frozenset(j for j, flat in enumerate(ix.flat) if flat in call.mutated)
        sub = OpCall(call.op, (), {}, ix.specs, None, mutated, (0,) if mutated else None)
        pats = pointwise.patterns(name, overload, ix.spec_index)
        shape = ix.specs[0].shape
        decision = choose(sub, pointwise.strategies(ix.specs, shape, pats))
        for j, flat in enumerate(ix.flat):
            if flat not in shared:
                inputs[flat] = decision.inputs[j]
        outputs.append(decision.outputs[0])
    n_out = len(call.outs or ())
    return Sharding(tuple(inputs), tuple(outputs[:n_out]) if n_out else ())


register(*foreach_ops())(foreach_rule)
# the rule reads no scalar's value (each index is its pointwise op's, and those are value
# free): dispatch keys a float, alone or in a ScalarList, by its type, so AdamW's per-step
# step sizes and bias corrections (_foreach_addcdiv_, _foreach_div_) reuse one plan
FLOAT_VALUE_FREE.update(id(op) for op in foreach_ops())

__all__ = ["foreach_ops", "foreach_rule", "split_by_index"]
