"""What fully_shard sends per step, counted at plait.comm's door with CommDebugMode.

Per group and step: one all-gather before forward, one more before backward when the
group resharded after forward, one reduce-scatter after backward; nothing else (the
optimizer steps on local shards). Each all-gather carries the whole group (input (1, S),
S the group's padded shard numel), so the counts are per group, not per parameter.
"""

import pytest
import torch
import torch.nn.functional as F

from plait.debug import CommDebugMode
from plait.testing import distributed
from tests.fsdp.common import PER_RANK, batch, build, make_opt, mine, shard, world


def _padded(numel_rows: list[tuple[int, int]], n: int) -> int:
    """S for a group of (rows, row_numel) parameters on n ranks."""
    return sum(-(-rows // n) * row for rows, row in numel_rows)


@distributed([1, 2, 3])
@pytest.mark.parametrize("reshard", [True, False, None], ids=["reshard", "keep", "default"])
def test_collectives_per_step_and_group(reshard):
    _, rank, n = world()
    model = shard(build("mlp"), reshard_after_forward=reshard)
    opt = make_opt(model.parameters())
    sizes = {  # group -> S
        "root": _padded([(13, 7), (13, 1), (5, 13), (5, 1)], n),
        "block0": _padded([(11, 13), (11, 1)], n),
        "block1": _padded([(13, 11), (13, 1)], n),
    }
    root_regathers = reshard is True  # None: torch's default keeps the root unsharded
    blocks_regather = reshard in (True, None)
    expected_gathers = sorted([sizes["root"]] * (1 + root_regathers)
                              + [sizes["block0"], sizes["block1"]] * (1 + blocks_regather))
    for step in range(3):
        x, y = batch("mlp", step, n * PER_RANK)
        with CommDebugMode() as mode:
            F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
            opt.step()
            opt.zero_grad()
        counts = mode.get_comm_counts()
        assert dict(counts) == {"all_gather": len(expected_gathers), "reduce_scatter": 3}, dict(counts)
        gathers = sorted(e.input_shapes[0][1] for e in mode.events if e.op == "all_gather")
        assert gathers == expected_gathers, (gathers, expected_gathers)
        scatters = sorted(e.input_shapes[0][0] for e in mode.events if e.op == "reduce_scatter")
        assert scatters == sorted(n * s for s in sizes.values()), scatters
        assert all(e.input_shapes[0][0] == 1 for e in mode.events if e.op == "all_gather")


@distributed([2])
def test_bytes_per_step_match_the_zero3_formula():
    """Reshard after forward on every group: each rank sends 3 (N-1)/N of the padded
    parameter bytes per step (two all-gathers, one reduce-scatter); without, 2 (N-1)/N."""
    _, rank, n = world()
    for reshard, factor in ((True, 3), (False, 2)):
        model = shard(build("mlp"), reshard_after_forward=reshard)
        padded = sum(g.total for g in (s.group for s in _states(model)))  # S summed over groups
        x, y = batch("mlp", 0, n * PER_RANK)
        with CommDebugMode() as mode:
            F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
        full_bytes = n * padded * torch.float32.itemsize
        assert mode.get_total_bytes() == factor * (n - 1) * full_bytes // n, (reshard, mode.get_comm_bytes())


def _states(model):
    return [m._plait_fsdp_state for m in [*model.blocks, model]]


@distributed([4])
def test_reshard_after_forward_to_a_smaller_world():
    """reshard_after_forward=2 on 4 ranks (torch's meaning): after forward each rank keeps the
    rows a 2-rank all-gather rebuilds the parameters from, so backward all-gathers within
    consecutive pairs {0, 1}, {2, 3}: bytes (k-1) * (N/k) * S against (N-1) * S for a full
    re-gather; the losses, gradients and parameters are those of reshard_after_forward=True
    (and of one process), bitwise against True, as the values gathered are the same."""
    g, rank, n = world()
    k = 2
    model, full = shard(build("mlp"), reshard_after_forward=k), shard(build("mlp"), reshard_after_forward=True)
    states = _states(model)
    opt, full_opt = make_opt(model.parameters()), make_opt(full.parameters())
    for step in range(3):
        x, y = batch("mlp", step, n * PER_RANK)
        with CommDebugMode() as mode:
            out = model(mine(x, rank))
            kept = [s.group._post for s in states]
            loss = F.cross_entropy(out, mine(y, rank))
            loss.backward()
        full_loss = F.cross_entropy(full(mine(x, rank)), mine(y, rank))
        full_loss.backward()
        assert torch.equal(loss, full_loss), step
        for s, rows in zip(states, kept):
            assert rows is not None and tuple(rows.shape) == (n // k, s.group.total), s.group.name
            assert s.group._post is None  # freed by backward's gather
        gathers = [e for e in mode.events if e.op == "all_gather"]
        post = [e for e in gathers if len(e.group_ranks) == k]
        assert len(post) == len(states), [e.group_ranks for e in gathers]  # one pair-gather per group
        assert all(e.group_ranks == tuple(range(rank // k * k, rank // k * k + k)) for e in post)
        assert sorted(e.bytes_sent for e in post) == sorted(
            (k - 1) * (n // k) * s.group.total * 4 for s in states)
        for p, q in zip(model.parameters(), full.parameters()):
            assert torch.equal(p.grad.to_local(), q.grad.to_local())
        for o in (opt, full_opt):
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), full.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
