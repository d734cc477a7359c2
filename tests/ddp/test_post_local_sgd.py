"""Post-local SGD: plait's hook, averager and optimizer train exactly like torch's own.

Protocol: an MLP under DDP (several buckets), rank r trains on slice r of each step's
global batch; post_localSGD_hook with start_localSGD_iter=3, PeriodicModelAverager with
period=2 and warmup_steps=3, subgroups of 2 consecutive ranks (at world 4, {0,1} and
{2,3}: the local phase then really differs from global DDP), 8 steps. Steps 0-2 average
gradients over the world; from step 3 within the subgroup (or not at all); after the
optimizer step of steps 3, 5, 7 the parameters are averaged over the world.

Tolerances (float32): losses and parameters atol 1e-6 / rtol 1e-5 against torch. Both
divide each bucket by the group size and sum with Gloo, but torch's first iteration runs
one bucket where plait runs several, and Gloo's ring sums a chunk's elements in an order
set by the chunk boundaries: rounding, ~1e-7 relative per step, over 8 steps. A missed
or extra average (global instead of local, averaging on the wrong step) moves parameters
by ~1e-2. Among plait's own replicas equality is exact: members of one group receive the
same all-reduced bits.
"""

import io
import os
import warnings

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_post_local
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from plait import comm
from plait.ddp import DistributedDataParallel
from plait.ddp.comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    intra_node_subgroup,
    post_localSGD_hook,
)
from plait.ddp.model_averaging import PeriodicModelAverager
from plait.debug import CommDebugMode
from plait.optim.post_localSGD_optimizer import PostLocalSGDOptimizer
from plait.testing import assert_synced, distributed
from tests.ddp.common import batch, build, loss_fn, mine, world

STEPS, START, PERIOD, SUB = 8, 3, 2, 2
AVERAGED = {s for s in range(START, STEPS) if (s - START) % PERIOD == 0}  # {3, 5, 7}
BUCKET_MB = 0.0005  # several buckets for the MLP: the iteration counts by the last one


def my_subgroup():
    rank = comm.global_rank()
    return comm.new_group(list(range(rank - rank % SUB, rank - rank % SUB + SUB)))


def train(ddp, state, hook, averager_cls, optimizer_cls, front, steps=STEPS):
    """Per step: this rank's loss, and the backward's all-reduces (group ranks) in plait."""
    g, rank, n = world()
    ddp.register_comm_hook(state, hook)
    local = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    averager = averager_cls(period=PERIOD, warmup_steps=START)
    opt = optimizer_cls(local, averager) if front == "optimizer" else local
    losses, reduces = [], []
    for step in range(steps):
        x, y = batch("mlp", step, n * 3)
        with CommDebugMode() as mode:
            loss = loss_fn("mlp", ddp(mine(x, rank)), mine(y, rank))
            loss.backward()
        reduces.append([e.group_ranks for e in mode.events if e.op == "all_reduce"])
        opt.step()
        if front == "averager":
            averager.average_parameters(ddp.parameters())
        opt.zero_grad()
        losses.append(loss.item())
    return losses, reduces


@distributed([2, 4])
@pytest.mark.parametrize("front,local_allreduce", [("averager", True), ("optimizer", False)])
def test_post_local_sgd_matches_torch(front, local_allreduce):
    g, rank, n = world()
    sub = my_subgroup()
    ours, theirs = build("mlp", seed=rank), build("mlp", seed=rank)
    ddp = DistributedDataParallel(ours, bucket_cap_mb=BUCKET_MB)
    torch_ddp = TorchDDP(theirs, bucket_cap_mb=BUCKET_MB)
    state = PostLocalSGDState(None, sub, START, post_local_gradient_allreduce=local_allreduce)
    torch_state = torch_post_local.PostLocalSGDState(None, sub, START, post_local_gradient_allreduce=local_allreduce)
    losses, _ = train(ddp, state, post_localSGD_hook, PeriodicModelAverager, PostLocalSGDOptimizer, front)
    want, _ = train(torch_ddp, torch_state, torch_post_local.post_localSGD_hook,
                    torch_averagers.PeriodicModelAverager, TorchPostLocalSGDOptimizer, front)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), atol=1e-6, rtol=1e-5)
    assert state.iter == torch_state.iter == START
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        assert_synced(a, g, name=name)  # the last step (7) averaged over the world


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def equal_to(mine_: torch.Tensor, group) -> list[bool]:
    """For each rank of `group`: does it hold exactly this rank's tensor?"""
    everyone = comm.all_gather(mine_.reshape(1, -1), group=group)  # (n, numel)
    return [torch.equal(row, mine_) for row in everyone]


@distributed([4])
@pytest.mark.parametrize("local_allreduce", [True, False])
def test_local_phase_does_not_average_globally(local_allreduce):
    g, rank, n = world()
    before = os.environ["LOCAL_WORLD_SIZE"]
    os.environ["LOCAL_WORLD_SIZE"] = str(SUB)  # two "nodes" of 2 ranks: subgroup=None finds them
    try:
        model = build("mlp", seed=rank)
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        state = PostLocalSGDState(None, None, START, post_local_gradient_allreduce=local_allreduce)
        ddp.register_comm_hook(state, post_localSGD_hook)
        opt = PostLocalSGDOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9),
                                    PeriodicModelAverager(period=PERIOD, warmup_steps=START))
        node = tuple(range(rank - rank % SUB, rank - rank % SUB + SUB))
        for step in range(STEPS):
            x, y = batch("mlp", step, n * 3)
            with CommDebugMode() as mode:
                loss_fn("mlp", ddp(mine(x, rank)), mine(y, rank)).backward()
            groups = {e.group_ranks for e in mode.events if e.op == "all_reduce"}
            if step < START:
                assert groups == {tuple(range(n))}, (step, groups)
            else:
                assert groups == ({node} if local_allreduce else set()), (step, groups)
            opt.step()
            opt.zero_grad()
            same = equal_to(flat_params(model), g)
            if step < START or step in AVERAGED:
                assert all(same), (step, same)  # global gradients, or just averaged
            else:  # between averages: the other subgroup has drifted away
                others = [r for r in range(n) if r not in node]
                assert not any(same[r] for r in others), (step, same)
                partner = [r for r in node if r != rank][0]
                assert same[partner] == local_allreduce, (step, same)  # same local gradient
        assert state.iter == START
        if local_allreduce:  # the default subgroup: this rank's "node"
            assert comm.group_info(state.subgroup).ranks == node
        else:  # never needed, never created
            assert state.subgroup is None
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = before


@distributed([2, 3])
def test_periodic_model_averager_on_param_groups_matches_torch():
    g, rank, n = world()
    torch.manual_seed(rank)
    ours = [torch.nn.Parameter(torch.randn(s, dtype=d)) for s, d in
            (((3, 2), torch.float32), ((5,), torch.float32), ((4,), torch.float64), ((2,), torch.float32))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for params in (ours, theirs):
        for p in params[:3]:
            p.grad = torch.zeros_like(p)  # the last has no gradient: never averaged
    groups = [{"params": ours[:2]}, {"params": ours[2:]}]
    torch_groups = [{"params": theirs[:2]}, {"params": theirs[2:]}]
    averager = PeriodicModelAverager(period=3, warmup_steps=2)
    torch_averager = torch_averagers.PeriodicModelAverager(period=3, warmup_steps=2)
    untouched = ours[3].detach().clone()
    for call in range(7):
        with torch.no_grad():  # every rank drifts its own way between calls
            for a, b in zip(ours, theirs):
                noise = torch.randn(a.shape, dtype=a.dtype, generator=torch.Generator().manual_seed(10 * call + rank))
                a.add_(noise)
                b.add_(noise)
        untouched += torch.randn(2, generator=torch.Generator().manual_seed(10 * call + rank))
        if call % 2:  # a model's parameters() on odd calls, an optimizer's param_groups on even
            averager.average_parameters(iter(ours))
            torch_averager.average_parameters(iter(theirs))
        else:
            averager.average_parameters(groups)
            torch_averager.average_parameters(torch_groups)
        assert averager.step == torch_averager.step == call + 1
        for k, (a, b) in enumerate(zip(ours, theirs)):
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m, k=k, call=call: f"call {call} param {k}: {m}")
        synced = all(equal_to(ours[0].detach().reshape(-1), g))
        assert synced == (call in (2, 5)), (call, synced)
        torch.testing.assert_close(ours[3].detach(), untouched)


def test_periodic_model_averager_rejects_bad_arguments():
    with pytest.raises(ValueError, match="period"):
        PeriodicModelAverager(period=0, process_group=object())
    with pytest.raises(ValueError, match="warmup_steps"):
        PeriodicModelAverager(period=2, warmup_steps=-1, process_group=object())
    with pytest.warns(UserWarning, match="period is 1"):
        PeriodicModelAverager(period=1, process_group=object())


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the device count sizes the node")
def test_default_subgroup_needs_the_ranks_per_node(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        intra_node_subgroup(None)


def local_training(opt, model, steps, first_step):
    g, rank, n = world()
    for step in range(first_step, first_step + steps):
        x, y = batch("mlp", step, n * 3)
        loss_fn("mlp", model(mine(x, rank)), mine(y, rank)).backward()
        opt.step()
        opt.zero_grad()


def checkpoint(state):
    """Through bytes, as a checkpoint goes: the live state dict aliases momentum buffers."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def make_optimizer(cls, averager_cls, model):
    return cls(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
               averager_cls(period=PERIOD, warmup_steps=START))


@distributed([2])
def test_post_local_sgd_optimizer_state_dict_round_trip():
    g, rank, n = world()
    model = build("mlp", seed=rank)  # no DDP: every step is local, only the averager syncs
    opt = make_optimizer(PostLocalSGDOptimizer, PeriodicModelAverager, model)
    local_training(opt, model, 4, 0)
    saved, saved_model = checkpoint(opt.state_dict()), checkpoint(model.state_dict())
    assert saved["step"] == 4 and set(saved) == {"state", "param_groups", "step"}
    theirs = build("mlp", seed=rank)
    torch_opt = make_optimizer(TorchPostLocalSGDOptimizer, torch_averagers.PeriodicModelAverager, theirs)
    local_training(torch_opt, theirs, 4, 0)
    assert set(torch_opt.state_dict()) == set(saved) and torch_opt.state_dict()["step"] == 4
    local_training(opt, model, 4, 4)  # averages after steps 5 and 7

    resumed = build("mlp", seed=99)
    resumed.load_state_dict(saved_model)
    opt2 = make_optimizer(PostLocalSGDOptimizer, PeriodicModelAverager, resumed)
    opt2.load_state_dict(saved)
    assert opt2.averager.step == 4
    local_training(opt2, resumed, 4, 4)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
        assert_synced(a, g, name=name)

    bare = opt2.optim.state_dict()  # saved by the bare optimizer: no "step"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt2.load_state_dict(bare)
    assert opt2.averager.step == 0 and any("step counter" in str(w.message) for w in caught)
