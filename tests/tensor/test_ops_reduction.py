"""Reductions and softmax on DTensors equal plain ones: sum, mean, amax, amin, max, min,
argmax, var, std, vector_norm (p = 1, 2, inf), softmax, log_softmax, over all dims, one
dim, keepdim, with every placement of the input on 1-2 ranks and a seeded sample on 3, 4
and 2x2 (_helpers.SAMPLE), uneven and empty shards, float32 and bfloat16, values and
gradients.

Tolerances: tests/tensor/_helpers.py (float32 1e-4: partial sums added in another order;
bfloat16 6e-2: a sharded reduction rounds each rank's partial before the cross-rank sum).
"""

import math

import torch

from plait.debug import CommDebugMode
from plait.tensor import Partial, Shard
from plait.tensor.placement import _NormPartial
from plait.testing import distributed

from ._helpers import check, combos, exact_dtensor, ints, mesh_for

REDUCTIONS = {
    "sum": lambda x: x.sum(),
    "sum_dim": lambda x: x.sum(0),
    "sum_keepdim": lambda x: x.sum(1, keepdim=True),
    "mean": lambda x: x.mean(),
    "mean_dim": lambda x: x.mean(0),
    "amax": lambda x: x.amax(0),
    "amin_keepdim": lambda x: x.amin(1, keepdim=True),
    "max": lambda x: x.max(),
    "max_dim": lambda x: x.max(1),
    "argmax": lambda x: x.argmax(0),
    "var": lambda x: x.var(0),
    "std": lambda x: x.std(1, correction=0),
    "norm2": lambda x: torch.linalg.vector_norm(x),
    "norm1_dim": lambda x: torch.linalg.vector_norm(x, 1, dim=1),
    "norm_inf": lambda x: torch.linalg.vector_norm(x, math.inf),
    "softmax": lambda x: torch.softmax(x, 1),
    "log_softmax": lambda x: torch.log_softmax(x, 0),
}


def _distinct(*shape, seed):
    """Distinct values (max/argmax have one answer) that are still exact in bf16."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(math.prod(shape), generator=g).float() / 8 - 2).view(shape)


@distributed([1, 2, 3, 4])
def test_reductions_every_placement(world_size):
    mesh = mesh_for(world_size)
    x = _distinct(5, 3, seed=8)  # uneven pieces
    for name, fn in REDUCTIONS.items():
        for (p,) in combos([2], mesh, seed=len(name)):
            check(fn, [x], [p], mesh, what=name)
    tiny = _distinct(2, 3, seed=5)  # empty pieces on 3 and 4 ranks: the identities
    for name in ("sum_dim", "mean", "amax", "max", "max_dim", "norm_inf", "var", "softmax"):
        for p in ([Shard(0)], [Shard(1)]):
            check(REDUCTIONS[name], [tiny], [p], mesh, what=f"{name} {tuple(tiny.shape)}")


@distributed([2, 4])
def test_reductions_bfloat16_and_2x2(world_size):
    mesh = mesh_for(world_size)
    x = _distinct(6, 5, seed=1)
    for name in ("sum_dim", "mean", "amax", "norm2", "softmax"):
        for (p,) in combos([2], mesh, seed=2):
            check(REDUCTIONS[name], [x], [p], mesh, dtype=torch.bfloat16, what=f"{name} bf16")
    if world_size == 4:
        mesh2 = mesh_for(4, two_d=True)
        for name in ("sum", "mean_dim", "max", "norm2", "var", "log_softmax"):
            for (p,) in combos([2], mesh2, limit=5, seed=len(name)):
                check(REDUCTIONS[name], [x], [p], mesh2, what=f"{name} 2x2")


@distributed([3])
def test_sharded_reductions_stay_partial():
    mesh = mesh_for(3)
    full = ints(7, 4, seed=1)
    x = exact_dtensor(full, mesh, [Shard(0)])
    with CommDebugMode() as mode:
        s, m, a, n = x.sum(0), x.mean(), x.amax(0), torch.linalg.vector_norm(x)
    assert mode.get_total_counts() == 0
    assert s.placements == (Partial("sum"),) and m.placements == (Partial("sum"),)
    assert a.placements == (Partial("max"),) and n.placements == (_NormPartial(2),)
    # the mean of uneven pieces (3, 3, 1 rows) is exact: not the average of local means
    torch.testing.assert_close(m.full_tensor(), full.mean())
    torch.testing.assert_close(n.full_tensor(), torch.linalg.vector_norm(full))
    assert x.sum(1).placements == (Shard(0),)
    # the norm of per-tensor norms stays partial: clip_grad_norm_'s one all-reduce
    norms = torch.stack([torch.linalg.vector_norm(x), torch.linalg.vector_norm(x * 2)])
    with CommDebugMode() as mode:
        total = torch.linalg.vector_norm(norms)
    assert mode.get_total_counts() == 0 and total.placements == (_NormPartial(2),)
    torch.testing.assert_close(total.full_tensor(), torch.linalg.vector_norm(full) * math.sqrt(5))
