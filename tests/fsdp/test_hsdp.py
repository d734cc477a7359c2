"""HSDP: fully_shard on a 2-D (replicate, shard) mesh of 2 x 2. Parameters are
(Replicate(), Shard(0)) DTensors: sharded within a shard-axis group of 2, replicated
across the replicate axis. Gradients are reduce-scattered on the shard axis, then
all-reduced on the replicate axis (one of each per group and step); with
set_requires_all_reduce(False) the all-reduce waits for the last micro-step. Parity with
one process on the whole batch (every one of the 4 ranks is a data-parallel rank);
tolerances as in test_parity.py."""

import torch.nn.functional as F

from plait.debug import CommDebugMode
from plait.device_mesh import init_device_mesh
from plait.tensor import Replicate, Shard
from plait.testing import chunk_sizes, distributed
from tests.fsdp.common import (
    PER_RANK,
    assert_full_params_close,
    assert_grads_close,
    batch,
    build,
    make_opt,
    mine,
    shard,
    train_parity,
    world,
)


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


@distributed([4])
def test_hsdp_parity_and_collectives():
    _, rank, n = world()
    mesh = _mesh()
    model, ref = shard(build("mlp"), mesh=mesh), build("mlp")
    shard_rank = mesh.get_local_rank("shard")
    for name, p in model.named_parameters():
        assert p.placements == (Replicate(), Shard(0)), name
        assert p._local_tensor.size(0) == chunk_sizes(p.size(0), 2)[shard_rank], name
    x, y = batch("mlp", 99, n * PER_RANK)
    with CommDebugMode() as mode:
        F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
    by_op = {}
    for e in mode.events:
        by_op.setdefault(e.op, []).append(e.group_ranks)
    shard_ranks = tuple(mesh["shard"].mesh.tolist())
    replicate_ranks = tuple(mesh["replicate"].mesh.tolist())
    assert by_op["reduce_scatter"] == [shard_ranks] * 3, by_op
    assert by_op["all_reduce"] == [replicate_ranks] * 3, by_op
    assert set(by_op["all_gather"]) == {shard_ranks}, by_op
    for p in model.parameters():
        p.grad = None
    train_parity("mlp", model, ref, steps=10)
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what="HSDP after 10 steps")


@distributed([4])
def test_hsdp_deferred_all_reduce():
    _, rank, n = world()
    model, ref = shard(build("mlp"), mesh=_mesh()), build("mlp")
    for k in range(3):
        last = k == 2
        model.set_requires_all_reduce(last)
        x, y = batch("mlp", k, n * PER_RANK)
        with CommDebugMode() as mode:
            F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
            F.cross_entropy(ref(x), y).backward()
        counts = mode.get_comm_counts()
        assert counts["reduce_scatter"] == 3 and counts["all_reduce"] == (3 if last else 0), dict(counts)
    assert_grads_close(model, ref, atol=1e-6, rtol=1e-4, what="after deferred all-reduce")
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    opt.step(), ref_opt.step()
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what="after one step")
