"""The sharding rule table: op -> rule, and the one way rules choose placements.

    rule(call: OpCall) -> Sharding(inputs, outputs, local_fn)

`OpCall` is the op's arguments with each DTensor replaced by its DTensorSpec (`call.specs`
lists them flat: positional args, then kwargs, tensor lists expanded) and the op's
outputs as meta tensors of the global shapes (`call.outs`). A `Sharding` says, per spec,
the placements it must arrive in (None: as it is), per tensor output its placements,
and optionally `local_fn(args, kwargs)` to run instead of the op on the local tensors.

Most rules list strategies for ONE mesh axis, `(input placements, output placements)`
(an input None: any), and `choose` picks, axis by axis, the strategy that moves the
fewest bytes from where the inputs are. This is torch's `register_sharding` format,
so a user's rule and ours go through the same chooser. Args an op writes in place
(`call.mutated`) keep their placements unless no strategy allows it (a Partial grad
meeting masked_fill_): then they move, in place, before the op (dispatch._move_in_place).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch._ops import OpOverload

from plait.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard
from plait.tensor.spec import DTensorSpec

aten = torch.ops.aten
PlacementsT = tuple[Placement, ...]
Strategy = tuple[Sequence[Placement | None], Sequence[Placement | None]]


class OpCall:
    """What a rule sees of one call (built once per distinct call signature)."""

    __slots__ = ("op", "args", "kwargs", "specs", "mesh", "outs", "mutated", "returns")

    def __init__(self, op: OpOverload, args: tuple, kwargs: dict, specs: list[DTensorSpec],
                 outs: list[torch.Tensor | None] | None, mutated: frozenset[int],
                 returns: tuple[int, ...] | None = None) -> None:
        self.op, self.args, self.kwargs, self.specs = op, args, kwargs, specs
        self.mesh = specs[0].mesh
        self.outs = outs  # flat meta outputs (None where the op returns None); None if unknown
        self.mutated = mutated  # indices into specs of the args the op writes
        self.returns = returns  # for an in-place op, the spec each output is (it keeps its layout)

    @property
    def out(self) -> torch.Tensor:
        assert self.outs, f"{self.op} has no tensor output"
        return self.outs[0]

    def arg(self, index: int, name: str, default=None):
        """Positional arg `index` or kwarg `name`."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)

    def choose(self, strategies: Sequence[Strategy] | Callable[[int], Sequence[Strategy]]) -> Sharding:
        return choose(self, strategies)


@dataclass(frozen=True)
class Sharding:
    inputs: tuple[PlacementsT | None, ...]
    outputs: tuple[PlacementsT | None, ...]
    local_fn: Callable | None = None

    def with_local_fn(self, fn: Callable) -> Sharding:
        return replace(self, local_fn=fn)


class NoStrategy(Exception):
    """Raised by a rule that cannot place this call (its outputs could not be computed on
    meta tensors, say): the planner takes the fallback, which is always right."""


Rule = Callable[[OpCall], Sharding]
RULES: dict[OpOverload, Rule] = {}
# ids of ops whose plan never depends on the value of a Python float argument (pointwise
# ops: x * 0.5 and x * 0.25 shard alike): dispatch keys such a float by its type, so an
# optimizer's per-step scalars (AdamW's step size, bias corrections) reuse one plan
FLOAT_VALUE_FREE: set[int] = set()


def register(*ops: OpOverload) -> Callable[[Rule], Rule]:
    """Register `rule` for every op in `ops` (later registrations override, and drop the
    op from FLOAT_VALUE_FREE: the new rule may read values)."""

    def decorate(rule: Rule) -> Rule:
        for op in ops:
            RULES[op] = rule
            FLOAT_VALUE_FREE.discard(id(op))
        return rule

    return decorate


def overloads(*packets, names: Sequence[str] | None = None) -> list[OpOverload]:
    """Every overload of each packet (or just `names`), skipping out= variants."""
    ops = []
    for packet in packets:
        for name in names or packet.overloads():
            if hasattr(packet, name) and not name.startswith("out") and "out" != name:
                ops.append(getattr(packet, name))
    return ops


# -- choosing -----------------------------------------------------------------------------------


def transition_cost(src: Placement, dst: Placement | None, nbytes: float, n: int) -> float:
    """Bytes a rank sends to move `src` to `dst` on an axis of `n` (1: a local copy)."""
    if dst is None or src == dst:
        return 0.0
    if n == 1:
        return 1.0
    share = nbytes * (n - 1) / n
    if type(src) is Replicate:
        return 1.0  # a chunk or a zero fill: local
    if type(src) is Shard or type(src) is _StridedShard:
        if type(dst) is Replicate:
            return share
        if type(dst) is Shard:
            return share / n + 1.0  # all-to-all: 1/n of the local
        return share + 1.0  # -> Replicate -> Partial
    if type(dst) is Shard:
        return share  # reduce-scatter
    return 2 * share + (1.0 if isinstance(dst, Partial) else 0.0)  # all-reduce (then partition)


MOVE_WRITTEN = 1e30  # moving an arg the op writes in place: only when nothing else works


def choose(call: OpCall, strategies) -> Sharding:
    """Per mesh axis, the cheapest strategy. Args the op writes in place keep their
    placements unless no strategy allows it (then they move, in place, first), and an
    in-place op's output has its written arg's placement."""
    specs, mesh = call.specs, call.mesh
    n_in = len(specs)
    inputs: list[list[Placement | None]] = [[None] * mesh.ndim for _ in range(n_in)]
    outputs: list[list[Placement]] | None = None
    for axis in range(mesh.ndim):
        options = strategies(axis) if callable(strategies) else strategies
        n = mesh.size(axis)
        best, best_cost = None, float("inf")
        for ins, outs in options:
            assert len(ins) == n_in, f"{call.op}: strategy has {len(ins)} inputs for {n_in} DTensor args"
            cost = 0.0
            for k, (spec, want) in enumerate(zip(specs, ins)):
                have = spec.placements[axis]
                if want is not None and want != have and k in call.mutated:
                    cost += MOVE_WRITTEN
                cost += transition_cost(have, want, spec.nbytes, n)
            if call.returns and any(outs[j] != (ins[k] or specs[k].placements[axis])
                                    for j, k in enumerate(call.returns) if j < len(outs)):
                continue  # an in-place op's output is its written arg: same layout
            if cost < best_cost:
                best, best_cost = (ins, outs), cost
        if best is None:
            have = [str(s.placements[axis]) for s in specs]
            raise RuntimeError(f"{call.op}: no sharding strategy on mesh axis {axis} for inputs {have}")
        ins, outs = best
        for k, want in enumerate(ins):
            inputs[k][axis] = want if want is not None else specs[k].placements[axis]
        if outputs is None:
            outputs = [[None] * mesh.ndim for _ in outs]
        for k, p in enumerate(outs):
            outputs[k][axis] = p
    return Sharding(
        inputs=tuple(tuple(p) for p in inputs),
        outputs=tuple(None if p[0] is None else tuple(p) for p in outputs or ()),
    )


def replicate_all(call: OpCall, n_out: int) -> Strategy:
    return (tuple(Replicate() for _ in call.specs), tuple(Replicate() for _ in range(n_out)))


def partials(specs: Sequence[DTensorSpec]) -> list[Partial]:
    """Every Partial placement (any reduce op, p-norms too) among `specs`, once each: what
    ops that only move values (cat, stack, clone, ...) pass through unchanged."""
    seen: list[Partial] = []
    for s in specs:
        for p in s.placements:
            if isinstance(p, Partial) and p not in seen:
                seen.append(p)
    return seen


def partial_ops(specs: Sequence[DTensorSpec]) -> list[str]:
    """The linear Partial reduce ops (sum, avg) that appear among `specs`, once each."""
    seen = []
    for s in specs:
        for p in s.placements:
            if type(p) is Partial and p.is_linear() and p.reduce_op not in seen:
                seen.append(p.reduce_op)
    return seen


# -- torch's register_sharding -----------------------------------------------------------------


def register_sharding(op: OpOverload | list[OpOverload]):
    """Register a sharding rule for `op` without touching plait (torch's experimental API).

    The decorated function takes the op's arguments (each DTensor replaced by its spec,
    which has `.shape`, `.ndim`, `.placements`) and returns a list of
    `(output_placements, input_placements)` for one mesh axis: one output placement per
    tensor output, one input placement per op argument (None for non-tensors). plait picks,
    per mesh axis, the cheapest acceptable one and redistributes the inputs to it.
    """
    ops = op if isinstance(op, list) else [op]

    def wrapper(fn):
        def rule(call: OpCall) -> Sharding:
            strategies = []
            for outs, ins in fn(*call.args, **call.kwargs):
                strategies.append((_per_spec(call, list(ins)), tuple(outs)))
            return call.choose(strategies)

        for overload in ops:
            RULES[overload] = rule
            FLOAT_VALUE_FREE.discard(id(overload))  # the user's rule may read a float's value
        _forget_plans(ops)
        return fn

    return wrapper


def _forget_plans(ops: list[OpOverload]) -> None:
    """Drop dispatch's cached plans for `ops`: a call already seen must use the new rule."""
    from plait.tensor import dispatch  # dispatch imports this module

    ids = {id(op) for op in ops}
    for key in [k for k in dispatch._plans if k[0] in ids]:
        del dispatch._plans[key]


def _per_spec(call: OpCall, per_arg: list) -> tuple[Placement | None, ...]:
    """Spread a placement-per-argument list over the call's flat spec list."""
    out: list[Placement | None] = []
    values = list(call.args) + list(call.kwargs.values())
    per_arg = per_arg + [None] * (len(values) - len(per_arg))
    for value, p in zip(values, per_arg):
        if isinstance(value, DTensorSpec):
            out.append(p)
        elif isinstance(value, (list, tuple)):
            out.extend(p for v in value if isinstance(v, DTensorSpec))
    if len(out) != len(call.specs):
        raise ValueError(f"{call.op}: the rule's input placements cover {len(out)} DTensor args, "
                         f"the call has {len(call.specs)}")
    return tuple(out)


__all__ = [
    "NoStrategy", "OpCall", "RULES", "Sharding", "Strategy", "aten", "choose", "overloads", "partial_ops", "partials", "register",
    "register_sharding", "replicate_all", "transition_cost",
]
