"""View, slicing and joining ops on DTensors equal plain ones: t, transpose, permute,
view/reshape (merging and splitting dims, evenly and unevenly cut), flatten, unflatten,
squeeze, unsqueeze, expand, slice, select, split, chunk, cat, stack, index_select, and
the *_like / new_* factories, with every placement of the input on 1-2 ranks and a
seeded sample on 3, 4 and 2x2 (see _helpers.SAMPLE), values and gradients.

These ops only move values: float32 results must match exactly (atol = rtol = 0).
"""

import torch

from plait.debug import CommDebugMode
from plait.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from plait.testing import distributed

from ._helpers import check, combos, exact_dtensor, ints, mesh_for

EXACT = dict(atol=0, rtol=0)

def _index(x):
    index = torch.tensor([3, 0, 3])
    return distribute_tensor(index, x.device_mesh, [Replicate()]) if isinstance(x, DTensor) else index


ONE = {  # name: (fn, shape)
    "t": (torch.t, (5, 3)),
    "transpose": (lambda x: x.transpose(0, 2), (2, 5, 3)),
    "permute": (lambda x: x.permute(2, 0, 1), (2, 5, 3)),
    "merge_even": (lambda x: x.reshape(8, 3), (4, 2, 3)),
    "merge_uneven": (lambda x: x.view(15), (5, 3)),
    "split_dim": (lambda x: x.view(2, 6, 3), (12, 3)),
    "flatten": (lambda x: x.flatten(1), (2, 5, 3)),
    "unflatten": (lambda x: x.unflatten(1, (3, 2)), (5, 6)),
    "reshape_transposed": (lambda x: x.t().reshape(15), (5, 3)),
    "squeeze_unsqueeze": (lambda x: x.unsqueeze(1).squeeze(1).squeeze(), (5, 1, 3)),
    "expand": (lambda x: x.expand(4, 5, 3), (1, 5, 3)),
    "slice": (lambda x: x[1:4, ::2], (5, 3)),
    "slice_whole": (lambda x: x[:, 0:3], (5, 3)),
    "select": (lambda x: x[2], (5, 3)),
    "split": (lambda x: x.split(2, dim=1), (5, 3)),
    "chunk": (lambda x: x.chunk(2, dim=0), (5, 3)),
    "unbind": (lambda x: x.unbind(1), (5, 3)),
    "index_select": (lambda x: x.index_select(0, _index(x)), (5, 3)),
    "clone_detach_to": (lambda x: x.clone().to(torch.float64), (5, 3)),
    "factories": (lambda x: (torch.zeros_like(x), torch.ones_like(x) * x, torch.full_like(x, 2.0),
                             x.new_zeros(x.shape) + x, x.new_ones(2, 2)), (5, 3)),
}


@distributed([1, 2, 3, 4])
def test_views_every_placement(world_size):
    mesh = mesh_for(world_size)
    for name, (fn, shape) in ONE.items():
        x = ints(*shape, seed=len(name))
        for (p,) in combos([len(shape)], mesh, seed=len(name)):
            check(fn, [x], [p], mesh, tol=EXACT, what=name)
    a, b = ints(5, 3, seed=1), ints(5, 2, seed=2)
    for pa, pb in combos([2, 2], mesh):
        check(lambda a, b: torch.cat([a, b], dim=1), [a, b], [pa, pb], mesh, tol=EXACT, what="cat")
    c = ints(5, 3, seed=3)
    for pa, pc in combos([2, 2], mesh, seed=1):
        check(lambda a, c: torch.stack([a, c], dim=1), [a, c], [pa, pc], mesh, tol=EXACT, what="stack")


@distributed([4])
def test_views_2x2_and_bfloat16():
    mesh = mesh_for(4, two_d=True)
    for name in ("merge_even", "merge_uneven", "split_dim", "transpose", "slice", "expand"):
        fn, shape = ONE[name]
        x = ints(*shape, seed=3)
        for (p,) in combos([len(shape)], mesh, limit=6, seed=len(name)):
            check(fn, [x], [p], mesh, tol=EXACT, what=name)
    flat = mesh_for(4)
    for name in ("merge_uneven", "unflatten", "select", "split", "factories"):
        fn, shape = ONE[name]
        for (p,) in combos([len(shape)], flat, limit=3, seed=len(name)):
            check(fn, [ints(*shape, seed=4)], [p], flat, dtype=torch.bfloat16, tol=EXACT, what=f"{name} bf16")


@distributed([2, 4])
def test_reshapes_keep_shards_when_the_cut_allows(world_size):
    mesh = mesh_for(world_size)
    n = world_size
    x = exact_dtensor(ints(4 * n, 3, 2, seed=1), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        flat = x.view(4 * n, 6)
        merged = x.reshape(4 * n * 6)
        split = x.view(n, 4, 6)
        moved = x.permute(2, 0, 1)
    assert mode.get_total_counts() == 0
    assert flat.placements == merged.placements == split.placements == (Shard(0),)
    assert moved.placements == (Shard(1),)
    uneven = exact_dtensor(ints(2 * n + 1, 3, seed=2), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        y = uneven.view(-1)  # (2n+1)*3 elements cut by rows != cut by elements: gather first
    assert mode.get_comm_counts()["all_gather"] == 1 and y.placements == (Replicate(),)
    p = exact_dtensor(ints(4, 6, seed=3), mesh, [Partial()])
    with CommDebugMode() as mode:
        q = p.view(2, 2, 6).transpose(0, 1)[0]
    assert mode.get_total_counts() == 0 and q.placements == (Partial(),)
    torch.testing.assert_close(q.full_tensor(), ints(4, 6, seed=3).view(2, 2, 6).transpose(0, 1)[0])
