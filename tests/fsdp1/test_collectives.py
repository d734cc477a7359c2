"""FullyShardedDataParallel is fully_shard behind another door: with FULL_SHARD and the
transformer policy it issues, step for step, the collectives fully_shard per block then
root issues (same ops, shapes and groups, in the same order); SHARD_GRAD_OP drops the
backward re-gathers; BackwardPrefetch moves the backward all-gathers, never the numbers."""

import pytest
import torch.nn.functional as F

from plait.debug import CommDebugMode
from plait.fsdp import BackwardPrefetch, ShardingStrategy
from plait.testing import distributed
from tests.fsdp.common import PER_RANK, batch, build, make_opt, mine, shard, world
from tests.fsdp1.common import wrap


def _step_events(model, step: int) -> list[tuple]:
    _, rank, n = world()
    x, y = batch("mlp", step, n * PER_RANK)
    opt = make_opt(model.parameters())
    with CommDebugMode() as mode:
        F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
        opt.step()
        opt.zero_grad()
    return [(e.op, tuple(map(tuple, e.input_shapes)), tuple(e.group_ranks)) for e in mode.events]


@distributed([2, 3])
def test_full_shard_issues_what_fully_shard_issues():
    ours = wrap(build("mlp"), forward_prefetch=True)  # fully_shard prefetches in forward
    theirs = shard(build("mlp"))
    for step in range(2):
        a, b = _step_events(ours, step), _step_events(theirs, step)
        assert a == b, (a, b)
        ops = [e[0] for e in a]
        assert ops.count("all_gather") == 5 and ops.count("reduce_scatter") == 3, ops  # the root keeps its own
    plain = wrap(build("mlp"))  # forward_prefetch=False: the same collectives, issued in order
    assert sorted(_step_events(plain, 0)) == sorted(_step_events(theirs, 0))


@distributed([2])
def test_shard_grad_op_gathers_once_per_step():
    events = _step_events(wrap(build("mlp"), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP), 0)
    ops = [e[0] for e in events]
    assert ops.count("all_gather") == 3 and ops.count("reduce_scatter") == 3, ops


@distributed([2])
@pytest.mark.parametrize("prefetch", [BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST, None],
                         ids=["pre", "post", "none"])
def test_backward_prefetch_order(prefetch):
    """Backward runs block1 then block0. PRE: block0's all-gather goes out when block1's
    backward starts, before block1's reduce-scatter; POST and None: after it."""
    model = wrap(build("mlp"), backward_prefetch=prefetch)
    events = _step_events(model, 0)
    backward = events[3:]  # after the forward's three all-gathers
    gathers = [i for i, e in enumerate(backward) if e[0] == "all_gather"]
    assert len(gathers) == 2, backward  # block1's re-gather, then block0's
    block0_gather = gathers[1]
    block1_scatter = next(i for i, e in enumerate(backward) if e[0] == "reduce_scatter")
    assert (block0_gather < block1_scatter) == (prefetch is BackwardPrefetch.BACKWARD_PRE), backward
