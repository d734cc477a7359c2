"""Placements, local shapes and redistribute plans: pure logic, no processes.

The layout is torch.chunk's along each Shard, applied in mesh-axis order; a plan is the
list of collectives (and local ops) a transition needs, per axis.
"""

import copy
import math

import pytest
import torch

from plait.tensor import Partial, Replicate, Shard
from plait.tensor.ops.registry import transition_cost
from plait.tensor.ops.view import view_groups
from plait.tensor.placement import (
    _NormPartial,
    chunk_offset,
    chunk_sizes,
    like_strides,
    local_shape_and_offset,
    logical_size,
    normalize,
)
from plait.tensor.redistribute import plan

R, P = Replicate(), Partial()


def test_placements_are_small_hashable_values():
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1) and Replicate() == Replicate()
    assert Partial() == Partial("sum") != Partial("avg")
    assert len({Shard(0), Shard(0), R, P, Partial("max")}) == 4
    assert repr(Shard(1)) == "Shard(dim=1)" and repr(R) == "Replicate()" and repr(P) == "Partial(sum)"
    assert str(Shard(1)) == "S(1)" and str(R) == "R" and str(Partial("max")) == "P(max)"
    assert Shard(2).is_shard() and Shard(2).is_shard(2) and not Shard(2).is_shard(1)
    assert R.is_replicate() and P.is_partial() and P.is_partial("sum") and not P.is_partial("max")
    with pytest.raises(AttributeError):
        Shard(0).dim = 1  # frozen
    with pytest.raises(ValueError, match="reduce_op 'mul' is not one of"):
        Partial("mul")
    assert _NormPartial(2) == _NormPartial(2.0) != Partial("sum")
    assert copy.deepcopy(Shard(0)) == Shard(0)


def test_normalize_checks_and_makes_dims_non_negative():
    assert normalize([Shard(-1), R], 3, 2) == (Shard(2), R)
    with pytest.raises(ValueError, match=r"must have the same length as `device_mesh.ndim`! Found placements length: 1, and device_mesh.ndim: 2"):
        normalize([R], 2, 2)
    with pytest.raises(ValueError, match=r"Shard\(dim=3\) is out of range for a tensor with 2 dims"):
        normalize([Shard(3)], 2, 1)
    with pytest.raises(TypeError, match="is not a Shard, Replicate or Partial"):
        normalize(["S0"], 2, 1)
    with pytest.raises(ValueError, match=r"mix Partial reduce ops \['max', 'sum'\]"):
        normalize([Partial("sum"), Partial("max")], 2, 2)


@pytest.mark.parametrize("size", [0, 1, 2, 5, 7, 8, 13])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_chunk_sizes_follow_torch_chunk(size, n):
    pieces = list(torch.arange(size).chunk(n)) if size else []
    expected = [len(p) for p in pieces] + [0] * (n - len(pieces))
    assert chunk_sizes(size, n) == expected
    starts = [chunk_offset(size, n, i)[1] for i in range(n)]
    assert [chunk_offset(size, n, i)[0] for i in range(n)] == expected
    assert all(starts[i] + expected[i] == (starts[i + 1] if i + 1 < n else size) for i in range(n))


def test_uneven_and_nested_local_shapes():
    assert chunk_sizes(7, 4) == [2, 2, 2, 1] and chunk_sizes(2, 4) == [1, 1, 0, 0]
    # (Shard(0), Shard(0)) on 2x2: axis 0 cuts 7 into 4,3; axis 1 cuts those into 2,2 and 2,1
    got = {c: local_shape_and_offset((7, 3), (Shard(0), Shard(0)), (2, 2), c) for c in
           [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert got == {(0, 0): ((2, 3), (0, 0)), (0, 1): ((2, 3), (2, 0)),
                   (1, 0): ((2, 3), (4, 0)), (1, 1): ((1, 3), (6, 0))}
    assert local_shape_and_offset((5, 6), (Shard(1), Shard(0)), (2, 3), (1, 2)) == ((1, 3), (4, 3))
    assert logical_size((7, 3), (Shard(0), Shard(0)), (2, 2), (1, 0), 1, 0) == 3
    assert like_strides((2, 3), (1, 2)) == (1, 2) and like_strides((2, 3), (3, 1)) == (3, 1)


def _kinds(steps):
    return [(s.kind, s.axis) for s in steps]


def test_plans_pick_the_collective_per_transition():
    shape, mesh, c = (8, 6), (4,), (1,)
    assert _kinds(plan(shape, [Shard(0)], [R], mesh, c)) == [("all_gather", 0)]
    assert _kinds(plan(shape, [P], [R], mesh, c)) == [("all_reduce", 0)]
    assert _kinds(plan(shape, [P], [Shard(1)], mesh, c)) == [("reduce_scatter", 0)]
    assert _kinds(plan(shape, [R], [Shard(1)], mesh, c)) == [("chunk", 0)]
    assert _kinds(plan(shape, [R], [P], mesh, c)) == [("partition", 0)]
    assert _kinds(plan(shape, [Shard(0)], [Shard(1)], mesh, c)) == [("all_to_all", 0)]
    assert _kinds(plan(shape, [Shard(0)], [P], mesh, c)) == [("all_gather", 0), ("partition", 0)]
    assert _kinds(plan(shape, [P], [Partial("max")], mesh, c)) == [("all_reduce", 0), ("partition", 0)]
    assert plan(shape, [Shard(0)], [Shard(0)], mesh, c) == ()
    uneven = plan((7, 2), [Shard(0)], [R], mesh, c)[0]
    assert uneven.sizes == (2, 2, 2, 1)


def test_nested_plans_respect_chunk_order():
    mesh, c = (2, 2), (0, 1)
    # (S0, S0) -> (R, S0): axis 1's chunks are cut inside axis 0's, so undo axis 1 first,
    # then axis 0, then cut again on axis 1
    steps = plan((8, 4), [Shard(0), Shard(0)], [R, Shard(0)], mesh, c)
    assert _kinds(steps) == [("all_gather", 1), ("all_gather", 0), ("chunk", 1)]
    # (R, S0) -> (S0, S0): axis 0 must cut first
    assert _kinds(plan((8, 4), [R, Shard(0)], [Shard(0), Shard(0)], mesh, c)) == \
        [("all_gather", 1), ("chunk", 0), ("chunk", 1)]
    # independent dims move independently; all-to-all only when no other axis uses the dims
    assert _kinds(plan((8, 4), [Shard(0), Shard(1)], [Shard(1), Shard(0)], mesh, c)) == \
        [("all_gather", 1), ("all_gather", 0), ("chunk", 0), ("chunk", 1)]
    assert _kinds(plan((8, 4), [Shard(0), R], [Shard(1), R], mesh, c)) == [("all_to_all", 0)]
    assert _kinds(plan((8, 4), [P, Shard(1)], [Shard(0), Shard(1)], mesh, c)) == [("reduce_scatter", 0)]
    # the inner axis's sizes are those of this coordinate's outer piece
    steps = plan((7, 4), [Shard(0), Shard(0)], [Shard(0), R], mesh, (1, 0))
    assert steps[0].sizes == (2, 1)


def test_transition_costs_order_the_strategies():
    mb = 1 << 20
    assert transition_cost(R, R, mb, 4) == 0 and transition_cost(R, None, mb, 4) == 0
    assert transition_cost(R, Shard(0), mb, 4) < transition_cost(Shard(0), Shard(1), mb, 4)
    assert transition_cost(Shard(0), Shard(1), mb, 4) < transition_cost(Shard(0), R, mb, 4)
    assert transition_cost(P, Shard(0), mb, 4) == transition_cost(Shard(0), R, mb, 4)
    assert transition_cost(P, R, mb, 4) == 2 * transition_cost(Shard(0), R, mb, 4)
    assert math.isclose(transition_cost(Shard(0), R, mb, 4), mb * 3 / 4)


def test_view_groups_pair_runs_of_equal_product():
    assert view_groups((2, 3, 4), (6, 4)) == [([0, 1], [0]), ([2], [1])]
    assert view_groups((24,), (2, 3, 4)) == [([0], [0, 1, 2])]
    assert view_groups((2, 1, 6), (2, 6, 1)) == [([0], [0]), ([1], []), ([2], [1]), ([], [2])]
    assert view_groups((2, 6), (3, 4)) == [([0, 1], [0, 1])]
