"""Every redistribute transition, forward and backward, on 1-D meshes of 1-4 ranks (all
pairs of R, S(0), S(1), P(sum/avg/max/min)) and a 2x2 mesh (all 256 pairs of placement
tuples forward, a seeded sample backward), with uneven and empty shards, float32 and
bfloat16.

Values are small integers and every transition only moves or adds them, so results must
match exactly (atol = rtol = 0), bfloat16 included. Backward: the gradient of
sum(G * x.redistribute(dst).full_tensor()) with respect to x is G, arriving in x's
placements with Partial turned into Replicate.
"""

import itertools
import random

import pytest
import torch

from plait.debug import CommDebugMode
from plait.tensor import DTensor, Partial, Replicate, Shard
from plait.testing import distributed

from ._helpers import exact_dtensor, ints, mesh_for

EXACT = dict(atol=0, rtol=0)


def _grad_placements(placements):
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _check_transition(full, mesh, src, dst, grad: bool, salt: int = 0):
    x = exact_dtensor(full, mesh, src, salt=salt, requires_grad=grad)
    y = x.redistribute(mesh, dst)
    label = f"{[str(p) for p in src]} -> {[str(p) for p in dst]} shape={tuple(full.shape)} {full.dtype}"
    assert y.placements == tuple(dst), label
    assert tuple(y.to_local().shape) == y._spec.local_shape, label
    torch.testing.assert_close(y.full_tensor(), full, **EXACT, msg=lambda m: f"{label}: {m}")
    if grad:
        g = ints(*full.shape, seed=7, dtype=full.dtype)
        (y.full_tensor() * g).sum().backward()
        assert x.grad.placements == _grad_placements(src), label
        torch.testing.assert_close(x.grad.full_tensor(), g, **EXACT, msg=lambda m: f"{label} grad: {m}")


ONE_D = [Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("avg"), Partial("max"), Partial("min")]


@distributed([1, 2, 3, 4])
def test_every_transition_1d(world_size):
    mesh = mesh_for(world_size)
    shapes = [(7, 5), (2, 3)]  # uneven everywhere; (2, 3) leaves ranks with empty shards
    for shape, dtype in itertools.product(shapes, (torch.float32, torch.bfloat16)):
        full = ints(*shape, seed=sum(shape), dtype=dtype)
        for src, dst in itertools.product(ONE_D, ONE_D):
            grad = dtype is torch.float32 and not (isinstance(src, Partial) and src.reduce_op in ("max", "min"))
            _check_transition(full, mesh, [src], [dst], grad)


@distributed([4])
def test_every_transition_2x2():
    mesh = mesh_for(4, two_d=True)
    axis = [Replicate(), Shard(0), Shard(1), Partial("sum")]
    pairs = list(itertools.product(itertools.product(axis, repeat=2), repeat=2))
    full = ints(7, 5, seed=3)
    with_grad = set(random.Random(1).sample(range(len(pairs)), 40))
    for k, (src, dst) in enumerate(pairs):  # all 256; backward on a seeded sample of 40
        _check_transition(full, mesh, src, dst, grad=k in with_grad)
    sample = random.Random(0).sample(pairs, 24)  # empty pieces and bf16: a seeded sample
    for src, dst in sample:
        _check_transition(ints(3, 2, seed=5), mesh, src, dst, grad=False)
        _check_transition(ints(5, 6, seed=4, dtype=torch.bfloat16), mesh, src, dst, grad=False)


@distributed([2, 3])
def test_collectives_per_transition_and_async(world_size):
    mesh = mesh_for(world_size)
    full = ints(6, 4, seed=1)
    expect = {
        (Shard(0), Replicate()): {"all_gather": 1}, (Partial(), Replicate()): {"all_reduce": 1},
        (Partial(), Shard(1)): {"reduce_scatter": 1}, (Shard(0), Shard(1)): {"all_to_all": 1},
        (Replicate(), Shard(0)): {}, (Replicate(), Partial()): {},
    }
    for (src, dst), counts in expect.items():
        x = exact_dtensor(full, mesh, [src])
        with CommDebugMode() as mode:
            y = x.redistribute(mesh, [dst])
        assert dict(mode.get_comm_counts()) == counts, (src, dst, mode.get_comm_counts())
        torch.testing.assert_close(y.full_tensor(), full, **EXACT)
        # a redistributed result never shares memory with its source
        if x.to_local().numel() and y.to_local().numel():
            assert y.to_local().data_ptr() != x.to_local().data_ptr()
        z = x.redistribute(mesh, [dst], async_op=True)
        torch.testing.assert_close(z.full_tensor(), full, **EXACT)
    # forward_dtype / backward_dtype: the collective runs in the given dtype
    x = exact_dtensor(full, mesh, [Shard(0)], requires_grad=True)
    y = x.redistribute(mesh, [Replicate()], forward_dtype=torch.bfloat16, backward_dtype=torch.float64)
    assert y.dtype == torch.bfloat16
    (y.to_local().float() * 2).sum().backward()
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad.full_tensor(), torch.full((6, 4), 2.0))
    with pytest.raises(ValueError, match="same length as `device_mesh.ndim`! Found placements length: 2"):
        x.redistribute(mesh, [Replicate(), Replicate()])


@distributed([2])
def test_redistribute_keeps_the_same_dtensor_semantics():
    mesh = mesh_for(2)
    full = ints(4, 3, seed=2)
    x = exact_dtensor(full, mesh, [Shard(0)])
    y = x.redistribute(mesh, [Shard(0)])  # no-op: a new DTensor, same storage
    assert isinstance(y, DTensor) and y is not x and y.to_local().data_ptr() == x.to_local().data_ptr()
    y = x.redistribute(placements=[Shard(-1)])
    assert y.placements == (Shard(1),)
