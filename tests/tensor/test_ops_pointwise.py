"""Pointwise ops on DTensors equal the same ops on plain tensors: unary, binary and
ternary with broadcasting, in-place, every placement combination of the inputs on a 1-D
mesh (Replicate, Shard on each dim, Partial), a seeded sample on 2x2, float32 and
bfloat16; gradients where differentiable.

Tolerances: see tests/tensor/_helpers.py (float32 1e-4: reordered sums; bfloat16 6e-2:
8 significant bits, a sharded op rounds before and after the cross-rank reduction).
"""

import pytest
import torch
import torch.nn.functional as F

from plait.debug import CommDebugMode
from plait.tensor import Partial, Replicate, Shard
from plait.testing import distributed

from ._helpers import check, combos, exact_dtensor, ints, mesh_for

UNARY = {
    "neg": torch.neg, "gelu": F.gelu, "exp": lambda x: torch.exp(x / 4), "clone": torch.clone,
    "to_bf16": lambda x: x.to(torch.bfloat16).float(), "mul_scalar": lambda x: x * 3,
    "add_scalar": lambda x: x + 1.5, "clamp": lambda x: x.clamp(-1, 2),
}
BINARY = {  # name: (fn, shape_a, shape_b)
    "add": (torch.add, (5, 3), (5, 3)),
    "sub_row": (lambda a, b: a - 2 * b, (5, 3), (3,)),
    "mul_col": (torch.mul, (5, 3), (5, 1)),
    "div": (lambda a, b: a / (b.abs() + 1), (5, 3), (1, 3)),
    "maximum": (torch.maximum, (5, 3), (5, 3)),
    "gelu_bwd_like": (lambda a, b: torch.sigmoid(a) * b, (5, 3), (5, 3)),
}
IN_PLACE = {
    "add_": lambda a, b: a.clone().add_(b, alpha=2),
    "mul_": lambda a, b: a.clone().mul_(b),
    "copy_": lambda a, b: a.clone().copy_(b),
    "lerp_": lambda a, b: a.clone().lerp_(b, 0.25),
    "addcmul_": lambda a, b: a.clone().addcmul_(b, b, value=0.5),
}


@distributed([1, 2, 3, 4])
def test_unary_and_binary_every_placement(world_size):
    mesh = mesh_for(world_size)
    x = ints(5, 3, seed=1)
    for name, fn in UNARY.items():
        for (p,) in combos([2], mesh):
            check(fn, [x], [p], mesh, what=name)
    for name, (fn, sa, sb) in BINARY.items():
        a, b = ints(*sa, seed=2), ints(*sb, seed=3)
        for pa, pb in combos([len(sa), len(sb)], mesh):
            check(fn, [a, b], [pa, pb], mesh, what=name)
    for name, fn in IN_PLACE.items():
        a, b = ints(5, 3, seed=4), ints(5, 3, seed=5)
        for pa, pb in combos([2, 2], mesh):
            check(fn, [a, b], [pa, pb], mesh, what=name)
    cond = ints(5, 3, seed=6) > 0
    for pc, pa, pb in combos([2, 2, 2], mesh, partial=False):
        check(torch.where, [cond, ints(5, 3, seed=7), ints(5, 3, seed=8)], [pc, pa, pb], mesh, what="where")


@distributed([2, 4])
def test_bfloat16_and_2x2(world_size):
    mesh = mesh_for(world_size)
    a, b = ints(5, 3, seed=1), ints(5, 3, seed=2)
    for pa, pb in combos([2, 2], mesh):
        check(lambda a, b: F.gelu(a) * b + a, [a, b], [pa, pb], mesh, dtype=torch.bfloat16, what="bf16")
    if world_size == 4:
        mesh2 = mesh_for(4, two_d=True)
        for pa, pb in combos([2, 1], mesh2, limit=24, seed=1):
            check(lambda a, b: torch.tanh(a) * b + a, [a, ints(3, seed=3)], [pa, pb], mesh2, what="2x2")
        for pa, pb in combos([2, 2], mesh2, limit=16, seed=2):
            check(lambda a, b: a.clone().add_(b), [a, b], [pa, pb], mesh2, what="2x2 add_")


@distributed([2])
def test_linear_ops_keep_partial_without_communication():
    mesh = mesh_for(2)
    a = exact_dtensor(ints(4, 3, seed=1), mesh, [Partial()])
    b = exact_dtensor(ints(4, 3, seed=2), mesh, [Partial()])
    r = exact_dtensor(ints(4, 3, seed=3), mesh, [Replicate()])
    with CommDebugMode() as mode:
        outs = [a + b, a - b, a * 2, a * r, a / 4, -a, a.clone(), torch.lerp(a, b, 0.3), a.to(torch.bfloat16)]
    assert mode.get_total_counts() == 0
    assert all(o.placements == (Partial(),) for o in outs)
    # a scalar added once per rank is not linear: the Partial is reduced first (reduce-scatter
    # is the cheapest way to a layout the op accepts)
    for y in (a + 1, torch.relu(a)):
        assert not y._spec.has_partial()
    torch.testing.assert_close((a + 1).full_tensor(), ints(4, 3, seed=1) + 1)
    # an in-place op that cannot run on a Partial moves its self (in place) first
    e = a.clone()
    assert e.exp_() is e and e.placements == (Replicate(),)
    torch.testing.assert_close(e.full_tensor(), ints(4, 3, seed=1).exp())
    with pytest.raises(ValueError, match="writes in place into a DTensor view"):
        a.view(12).exp_()  # moving a view would detach it from its base
    s = exact_dtensor(ints(4, 3, seed=4), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        c = s.clone().mul_(r)  # an in-place op moves the other operand, never self
    assert c.placements == (Shard(0),) and mode.get_total_counts() == 0
