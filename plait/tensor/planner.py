"""Building a dispatch plan: everything about one call signature that does not depend on
tensor values, computed once and cached by dispatch.

    DTensor args -> specs -> which args the op writes / returns (its schema)
      -> meta run on global shapes (output shapes) -> the op's rule -> Sharding
      -> per input: redistribute steps;  per output: DTensorSpec  -> Plan

An op without a rule, or whose outputs cannot be computed on meta tensors, gets the
fallback plan (replicate everything, see fallback.py).
"""

from __future__ import annotations

import torch

from plait.tensor import fallback, inplace_view, outsider, strided
from plait.tensor import redistribute as redist
from plait.tensor.dispatch import Plan
from plait.tensor.dtensor import DTensor
from plait.tensor.foreach_meshes import ByMeshPlan, is_foreach
from plait.tensor.ops import RULES, OpCall
from plait.tensor.ops.foreach import foreach_rule
from plait.tensor.ops.matmul import bmm_rule
from plait.tensor.ops.pointwise import pointwise_rule
from plait.tensor.ops.reduction import foreach_norm_rule, reduction_rule
from plait.tensor.ops.registry import NoStrategy
from plait.tensor.ops.tensor_ops import like_rule, new_rule
from plait.tensor.ops.view import permute_rule, reshape_rule, squeeze_rule, t_rule, transpose_rule
from plait.tensor.placement import has_strided, shard_order
from plait.tensor.spec import DTensorSpec, same_mesh

# the rules that place a _StridedShard input themselves (its piece is one block of the tensor)
STRIDED_RULES = (pointwise_rule, foreach_rule, reduction_rule, foreach_norm_rule, like_rule, new_rule,
                 t_rule, transpose_rule, permute_rule, reshape_rule, squeeze_rule, bmm_rule)


def _positions(args, kwargs) -> list:
    pos = []
    for i, a in enumerate(args):
        if type(a) is DTensor:
            pos.append((None, i))
        elif type(a) in (list, tuple):
            pos.extend((i, j) for j, e in enumerate(a) if type(e) is DTensor)
    for k, v in kwargs.items():
        if type(v) is DTensor:
            pos.append((k, None))
        elif type(v) in (list, tuple):
            pos.extend((k, j) for j, e in enumerate(v) if type(e) is DTensor)
    return pos


def _spec_tree(a, specs: dict[int, DTensorSpec]):
    t = type(a)
    if t is DTensor:
        return specs.get(id(a), a._spec)
    if t in (list, tuple):
        return t(_spec_tree(e, specs) for e in a)
    return a


def build(op, args, kwargs, dts: list[DTensor]) -> Plan:
    """The plan for this call (see the module note). A _StridedShard input meets only the
    rules that know it (pointwise, foreach, reductions, *_like); for any other op, or a
    choice that is no valid layout, it is first gathered to its plain layout (strided.py).
    An in-place view op (squeeze_) plans its out-of-place twin (inplace_view.py)."""
    if torch.Tag.inplace_view in op.tags and len(dts) == 1 and type(args[0]) is DTensor:
        out_of_place = inplace_view.twin(op)
        if out_of_place is not None and out_of_place in RULES:
            plan = build(out_of_place, args, kwargs, dts)
            if type(plan) is Plan and len(plan.out_specs) == 1:
                return inplace_view.InplaceViewPlan(op, plan)
    specs = [d._spec for d in dts]
    if specs and specs[0].mesh._coordinate is None:  # this rank is outside the call's mesh
        returns = _aliasing(op, _positions(args, kwargs))[1]
        return outsider.plan(op, args, kwargs, specs[0].mesh, returns,
                             lambda: _build(op, args, kwargs, dts, specs))
    if any(has_strided(s.placements) for s in specs):
        if RULES.get(op) in STRIDED_RULES:
            try:
                plan = _build(op, args, kwargs, dts, specs)
                if _valid(plan):
                    return plan
            except ValueError:  # a chosen move to no valid layout (strided.plan checks)
                pass
        return _build_unstrided(op, args, kwargs, dts, specs)
    return _build(op, args, kwargs, dts, specs)


def _valid(plan: Plan) -> bool:
    """Whether every layout the plan leads to is one shard_order accepts (a fallback or
    by-mesh plan moves from each input's own spec, so it always is)."""
    if type(plan) is not Plan:
        return True
    try:
        for s in plan.out_specs:
            if s is not None and has_strided(s.placements):
                shard_order(s.placements, s.mesh.shape)
        for _, spec in plan.moved:
            shard_order(spec.placements, spec.mesh.shape)
    except ValueError:
        return False
    return True


def _build_unstrided(op, args, kwargs, dts: list[DTensor], specs: list[DTensorSpec]) -> Plan:
    """The plan with every strided input gathered to its plain layout first."""
    plain = [s.with_placements(strided.unstrided(s.placements)) for s in specs]
    pre = [redist.plan_for(s, u.placements) for s, u in zip(specs, plain)]
    plan = _build(op, args, kwargs, dts, plain)
    if isinstance(plan, ByMeshPlan):
        return plan  # it plans each mesh's call again
    if isinstance(plan, fallback.FallbackPlan):  # it replicates every input from its own spec
        return _build(op, args, kwargs, dts, specs)
    steps = tuple((p + (s or ())) or None for p, s in zip(pre, plan.steps))
    moved = dict(plan.moved)
    for k in _aliasing(op, plan.positions)[0]:
        if pre[k]:
            moved.setdefault(k, plain[k])
    return Plan(op, plan.mesh, steps, plan.out_specs, plan.local_fn, plan.positions, plan.returns,
                tuple(moved.items()), plan.math_bits)


def _build(op, args, kwargs, dts: list[DTensor], specs: list[DTensorSpec]) -> Plan:
    mesh = specs[0].mesh
    for s in specs[1:]:
        if not same_mesh(s.mesh, mesh):
            if is_foreach(op):
                return ByMeshPlan(op)  # elementwise over lists: one call per mesh
            raise ValueError(f"{op}: DTensor args live on different meshes, {mesh} and {s.mesh}")
    positions = _positions(args, kwargs)
    written, returns = _aliasing(op, positions)
    rule = RULES.get(op)
    if rule is None:
        return fallback.plan(op, mesh, specs, positions, written, returns)
    outs = fallback.meta_outputs(op, args, kwargs)
    by_id = {id(d): s for d, s in zip(dts, specs)}
    call = OpCall(op, _spec_tree(tuple(args), by_id), {k: _spec_tree(v, by_id) for k, v in kwargs.items()},
                  specs, outs, written, returns)
    try:
        sharding = rule(call)
    except NoStrategy:
        return fallback.plan(op, mesh, specs, positions, written, returns)
    n_out = len(sharding.outputs)
    if outs is None and returns is None and n_out:
        return fallback.plan(op, mesh, specs, positions, written, returns)
    steps = []
    for spec, want in zip(specs, sharding.inputs):
        steps.append(None if want is None or want == spec.placements else redist.plan_for(spec, want) or None)
    out_specs = []
    if returns is None and n_out:
        assert len(outs) == n_out, f"{op}: rule gives {n_out} outputs, the op has {len(outs)}"
        for meta, placements in zip(outs, sharding.outputs):
            out_specs.append(None if meta is None else
                             DTensorSpec(mesh, placements, tuple(meta.shape), tuple(meta.stride()), meta.dtype))
    moved = tuple((k, specs[k].with_placements(sharding.inputs[k])) for k in written if steps[k] is not None)
    complex_ = any(s.dtype.is_complex for s in specs) or any(o is not None and o.dtype.is_complex for o in outs or ())
    return Plan(op, mesh, tuple(steps), tuple(out_specs), sharding.local_fn, positions, returns, moved, complex_)


def _aliasing(op, positions) -> tuple[frozenset[int], tuple[int, ...] | None]:
    """The DTensor args the op writes (by index into `positions`), and the ones it returns
    (None: it returns new tensors; (): it returns nothing)."""
    schema = op._schema
    by_name = {a.name: a for a in schema.arguments}
    written: list[int] = []
    for k, (where, i) in enumerate(positions):
        arg = by_name.get(where) if type(where) is str else schema.arguments[i if where is None else where]
        if arg is not None and arg.alias_info is not None and arg.alias_info.is_write:
            written.append(k)
    if not written:
        return frozenset(), None
    if not schema.returns:
        return frozenset(written), ()
    returns = []
    for ret in schema.returns:
        if ret.alias_info is None or not ret.alias_info.is_write:
            return frozenset(written), None
        for k in written:
            where, i = positions[k]
            arg = by_name.get(where) if type(where) is str else schema.arguments[i if where is None else where]
            if arg.alias_info.before_set == ret.alias_info.before_set and (where is None or type(where) is str):
                returns.append(k)
                break
        else:
            return frozenset(written), None
    return frozenset(written), tuple(returns)


__all__ = ["build"]
