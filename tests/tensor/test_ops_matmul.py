"""Matrix products on DTensors equal plain ones: mm, addmm, bmm, baddbmm, dot, mv, and
linear / matmul (which decompose into views and these), every placement combination of
the two operands on a 1-D mesh and a seeded sample on 2x2, with uneven sizes (5, 3, 7
do not divide 2, 3 or 4), float32 and bfloat16, values and gradients.

Tolerances: tests/tensor/_helpers.py (float32 1e-4: a contraction split over ranks sums
the same products in another order; bfloat16 6e-2: two roundings, see there).
"""

import torch
import torch.nn.functional as F

from plait.debug import CommDebugMode
from plait.tensor import Partial, Replicate, Shard
from plait.testing import distributed

from ._helpers import check, combos, exact_dtensor, ints, mesh_for

TWO = {  # name: (fn, shape_a, shape_b)
    "mm": (torch.mm, (5, 7), (7, 3)),
    "bmm": (torch.bmm, (3, 5, 2), (3, 2, 4)),
    "dot": (torch.dot, (7,), (7,)),
    "mv": (torch.mv, (5, 7), (7,)),
    "matmul_3d_2d": (torch.matmul, (2, 5, 7), (7, 3)),
    "linear_no_bias": (F.linear, (2, 5, 7), (3, 7)),
}
THREE = {
    "addmm": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5), (3,), (5, 7), (7, 3)),
    "baddbmm": (torch.baddbmm, (1, 5, 4), (3, 5, 2), (3, 2, 4)),
    "linear": (lambda x, w, b: F.linear(x, w, b), (2, 5, 7), (3, 7), (3,)),
}


@distributed([1, 2, 3, 4])
def test_products_every_placement(world_size):
    mesh = mesh_for(world_size)
    for name, (fn, sa, sb) in TWO.items():
        a, b = ints(*sa, seed=1), ints(*sb, seed=2)
        for pa, pb in combos([len(sa), len(sb)], mesh):
            check(fn, [a, b], [pa, pb], mesh, what=name)
    for name, (fn, sc, sa, sb) in THREE.items():
        c, a, b = ints(*sc, seed=3), ints(*sa, seed=4), ints(*sb, seed=5)
        limit = {1: 40, 2: 20}.get(world_size, 8)
        for pc, pa, pb in combos([len(sc), len(sa), len(sb)], mesh, limit=limit, seed=world_size):
            check(fn, [c, a, b], [pc, pa, pb], mesh, what=name)


@distributed([2, 4])
def test_products_bfloat16_and_2x2(world_size):
    mesh = mesh_for(world_size)
    a, b = ints(5, 7, seed=1), ints(7, 3, seed=2)
    for pa, pb in combos([2, 2], mesh):
        check(torch.mm, [a, b], [pa, pb], mesh, dtype=torch.bfloat16, what="mm bf16")
    if world_size == 4:
        mesh2 = mesh_for(4, two_d=True)
        for pa, pb in combos([2, 2], mesh2, limit=40, seed=3):
            check(torch.mm, [a, b], [pa, pb], mesh2, what="mm 2x2")
        x, w = ints(2, 5, 7, seed=3), ints(3, 7, seed=4)
        for px, pw in combos([3, 2], mesh2, limit=16, seed=4):
            check(F.linear, [x, w], [px, pw], mesh2, what="linear 2x2")


@distributed([2, 3])
def test_strategies_need_no_communication_when_layouts_fit(world_size):
    mesh = mesh_for(world_size)
    a, b = ints(6, 5, seed=1), ints(5, 4, seed=2)
    cases = [  # (a, b) -> out, with zero collectives
        (Shard(0), Replicate(), Shard(0)), (Replicate(), Shard(1), Shard(1)),
        (Shard(1), Shard(0), Partial()), (Partial(), Replicate(), Partial()),
        (Replicate(), Replicate(), Replicate()),
    ]
    for pa, pb, out in cases:
        da, db = exact_dtensor(a, mesh, [pa]), exact_dtensor(b, mesh, [pb])
        with CommDebugMode() as mode:
            y = da @ db
        assert mode.get_total_counts() == 0 and y.placements == (out,), (pa, pb, y.placements)
        torch.testing.assert_close(y.full_tensor(), a @ b)
    # a bias on a Partial product is added once: kept on coordinate 0 only
    bias = exact_dtensor(ints(4, seed=3), mesh, [Replicate()])
    y = torch.addmm(bias, exact_dtensor(a, mesh, [Shard(1)]), exact_dtensor(b, mesh, [Shard(0)]))
    assert y.placements == (Partial(),)
    torch.testing.assert_close(y.full_tensor(), ints(4, seed=3) + a @ b)
    # a plain 0-dim bias would be added on every rank: the product is reduced first
    y = torch.addmm(torch.tensor(2.0), exact_dtensor(a, mesh, [Shard(1)]), exact_dtensor(b, mesh, [Shard(0)]))
    assert not y._spec.has_partial()
    torch.testing.assert_close(y.full_tensor(), 2.0 + a @ b)
