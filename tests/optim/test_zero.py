"""ZeroRedundancyOptimizer: ZeRO-1 trains exactly like a plain optimizer, holds 1/N of its state,
and agrees with torch's own ZeroRedundancyOptimizer (partition, steps, state_dict, Join).

Protocol (tests/ddp/common.py): step t's global batch from seed t, rank r trains on slice r;
the MLP's six parameters (72, 12, 144, 12, 36, 3 elements) split unevenly over 2, 3 and 4 ranks.

Tolerances (float32). Against plain DDP + AdamW: exact. Both DDPs all-reduce the same gradients
in the same buckets, and AdamW's update is elementwise per tensor, so stepping a partition
locally computes the very bits the full optimizer computes; a wrong owner, a stale broadcast or
a lost state would differ by far more than rounding. Against torch's DDP + ZeRO: atol 1e-6 /
rtol 1e-5, because torch's DDP buckets its first iteration differently (Gloo sums chunks in
another order: rounding, see tests/ddp/test_join.py); the ZeRO parts have no rounding of their own.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from plait.ddp import DistributedDataParallel, Join
from plait.optim.zero_redundancy_optimizer import ZeroRedundancyOptimizer
from plait.testing import assert_synced, distributed
from tests.ddp.common import assert_params_close, batch, build, loss_fn, mine, world
from tests.optim import recipe_zero_plait, recipe_zero_torch

STEPS = 10
ADAMW = dict(lr=1e-2, weight_decay=0.1)
EXACT = dict(atol=0.0, rtol=0.0)
NEAR_TORCH = dict(atol=1e-6, rtol=1e-5)


def train_step(ddp, opt, step, rank, n):
    x, y = batch("mlp", step, 3 * n)
    loss = loss_fn("mlp", ddp(mine(x, rank)), mine(y, rank))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def owned(zero, model):
    """Indices (in model.parameters() order) of the parameters each rank owns."""
    index = {p: i for i, p in enumerate(model.parameters())}
    return [sorted(index[p] for g in groups for p in g["params"]) for groups in zero._partition_parameters()]


@distributed([2, 3, 4])
@pytest.mark.parametrize("bucket_view", [False, True], ids=["per_param", "bucket_view"])
def test_matches_plain_ddp_adamw(bucket_view):
    g, rank, n = world()
    plain, sharded = build("mlp", seed=0), build("mlp", seed=0)
    ddp_plain, ddp_sharded = DistributedDataParallel(plain), DistributedDataParallel(sharded)
    opt_plain = torch.optim.AdamW(ddp_plain.parameters(), **ADAMW)
    zero = ZeroRedundancyOptimizer(ddp_sharded.parameters(), optimizer_class=torch.optim.AdamW,
                                   parameters_as_bucket_view=bucket_view, **ADAMW)
    # a scheduler sets the outer param_groups' lr: the local optimizer must follow
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt_plain, zero)]
    for step in range(STEPS):
        expected = train_step(ddp_plain, opt_plain, step, rank, n)
        torch.testing.assert_close(train_step(ddp_sharded, zero, step, rank, n), expected, **EXACT,
                                   msg=lambda m, step=step: f"loss at step {step}: {m}")
        for schedule in schedules:
            schedule.step()
    assert_params_close(sharded, plain, **EXACT, what=f"ZeRO on {n} ranks vs AdamW")
    for name, p in sharded.named_parameters():
        assert_synced(p.detach(), g, name=name)


@distributed([2, 3])
@pytest.mark.parametrize("bucket_view", [False, True], ids=["per_param", "bucket_view"])
def test_freezing_a_layer_mid_training_matches_adamw(bucket_view):
    """fc2 stops training after step 3: its owner stops updating it, the buckets are rebuilt
    without it, and it stays the same on every rank. No DDP (it cannot change trainability):
    every rank takes the gradient of the whole batch, the one process does the same."""
    g, rank, n = world()
    plain, sharded = build("mlp", seed=0), build("mlp", seed=0)
    opt_plain = torch.optim.AdamW(plain.parameters(), **ADAMW)
    zero = ZeroRedundancyOptimizer(sharded.parameters(), optimizer_class=torch.optim.AdamW,
                                   parameters_as_bucket_view=bucket_view, **ADAMW)
    for step in range(6):
        x, y = batch("mlp", step, 3 * n)
        for model, opt in ((plain, opt_plain), (sharded, zero)):
            if step == 3:
                model.fc2.requires_grad_(False)
            loss_fn("mlp", model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert_params_close(sharded, plain, **EXACT, what="ZeRO with fc2 frozen vs AdamW")
    for name, p in sharded.named_parameters():
        assert_synced(p.detach(), g, name=name)


@distributed([2, 3, 4])
def test_state_is_sharded_by_torchs_partition():
    g, rank, n = world()
    model = build("mlp", seed=0)
    ddp = DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    reference = build("mlp", seed=0)
    theirs = TorchZeRO(reference.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    assert owned(zero, model) == owned(theirs, reference)
    train_step(ddp, zero, 0, rank, n)
    params = list(model.parameters())
    index = {p: i for i, p in enumerate(params)}
    mine_idx = owned(zero, model)[rank]
    assert sorted(index[p] for p in zero.optim.state) == mine_idx
    numel = sum(params[i].numel() for i in mine_idx)
    nbytes = sum(t.numel() * t.element_size() for s in zero.optim.state.values() for t in s.values())
    # AdamW: exp_avg and exp_avg_sq like the parameter (float32), plus a 0-dim float32 step each
    assert nbytes == sum(2 * params[i].numel() * 4 + 4 for i in mine_idx)
    full = torch.optim.AdamW(build("mlp", seed=0).parameters(), **ADAMW)
    for p in full.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    full.step()
    full_bytes = sum(t.numel() * t.element_size() for s in full.state.values() for t in s.values())
    totals = torch.tensor([numel, nbytes], dtype=torch.float64)
    dist.all_reduce(totals, group=g)
    assert totals.tolist() == [sum(p.numel() for p in params), full_bytes]


@distributed([2, 3])
@pytest.mark.parametrize("case", ["per_param", "bucket_view", "add_param_group"])
def test_matches_torchs_zero(case):
    g, rank, n = world()
    ours, theirs = build("mlp", seed=0), build("mlp", seed=0)
    ddp, torch_ddp = DistributedDataParallel(ours), TorchDDP(theirs)
    view = case == "bucket_view"
    late = case == "add_param_group"
    first = (lambda m: [*m.fc1.parameters(), *m.fc2.parameters()]) if late else (lambda m: list(m.parameters()))
    zero = ZeroRedundancyOptimizer(first(ours), optimizer_class=torch.optim.AdamW,
                                   parameters_as_bucket_view=view, **ADAMW)
    torch_zero = TorchZeRO(first(theirs), optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=view, **ADAMW)
    for step in range(STEPS):
        if late and step == 3:  # fc3 joins with its own learning rate
            zero.add_param_group({"params": list(ours.fc3.parameters()), "lr": 3e-2})
            torch_zero.add_param_group({"params": list(theirs.fc3.parameters()), "lr": 3e-2})
        a, b = train_step(ddp, zero, step, rank, n), train_step(torch_ddp, torch_zero, step, rank, n)
        torch.testing.assert_close(a, b, **NEAR_TORCH, msg=lambda m, step=step: f"loss at step {step}: {m}")
    assert owned(zero, ours) == owned(torch_zero, theirs)
    assert_params_close(ours, theirs, **NEAR_TORCH, what="plait ZeRO vs torch ZeRO")
    zero.consolidate_state_dict(to=n - 1)
    torch_zero.consolidate_state_dict(to=n - 1)
    if rank == n - 1:
        sd, torch_sd = zero.state_dict(), torch_zero.state_dict()
        assert sd["param_groups"] == torch_sd["param_groups"]
        assert sd["state"].keys() == torch_sd["state"].keys()
        torch.testing.assert_close(sd["state"], torch_sd["state"], **NEAR_TORCH)
    else:
        with pytest.raises(RuntimeError, match=f"consolidate_state_dict\\(to={rank}\\)"):
            zero.state_dict()


@distributed([2, 3])
def test_state_dict_round_trip_resumes_the_same_step():
    g, rank, n = world()
    model = build("mlp", seed=0)
    ddp = DistributedDataParallel(model)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    for step in range(3):
        train_step(ddp, zero, step, rank, n)
    zero.consolidate_state_dict()
    box = [zero.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=g)  # what a saved file gives every rank
    saved = box[0]
    resumed_model = build("mlp", seed=1)
    resumed_model.load_state_dict(model.state_dict())
    resumed_ddp = DistributedDataParallel(resumed_model)
    resumed = ZeroRedundancyOptimizer(resumed_ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=0.5)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["lr"] == ADAMW["lr"]  # the hyperparameters come back too
    # the global format is a plain AdamW's: one process can resume from it as well
    single = build("mlp", seed=1)
    single.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(single.parameters(), lr=0.5)
    plain.load_state_dict(saved)
    train_step(ddp, zero, 3, rank, n)
    train_step(resumed_ddp, resumed, 3, rank, n)
    assert saved["state"][0]["step"].item() == 3  # our load copied the state (torch's AdamW aliases it)
    x, y = batch("mlp", 3, 3 * n)
    loss_fn("mlp", single(x), y).backward()
    plain.step()
    assert_params_close(resumed_model, model, **EXACT, what="resumed ZeRO vs uninterrupted ZeRO")
    # one process on the whole batch: the same mean gradient, summed in another order
    assert_params_close(single, model, atol=1e-6, rtol=1e-5, what="plain AdamW from ZeRO's state dict")


@distributed([2, 3])
def test_join_with_uneven_inputs_matches_torch():
    g, rank, n = world()
    ours, theirs = build("mlp", seed=0), build("mlp", seed=0)
    ddp, torch_ddp = DistributedDataParallel(ours), TorchDDP(theirs)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    torch_zero = TorchZeRO(torch_ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    my_steps = 5 - 2 * (rank == n - 1)  # the last rank runs out of inputs two steps early
    with Join([ddp, zero]):
        for step in range(my_steps):
            train_step(ddp, zero, step, rank, n)
    with TorchJoin([torch_ddp, torch_zero]):
        for step in range(my_steps):
            train_step(torch_ddp, torch_zero, step, rank, n)
    assert_params_close(ours, theirs, **NEAR_TORCH, what="Join: plait vs torch")
    for name, p in ours.named_parameters():
        assert_synced(p.detach(), g, name=name)


@distributed([2, 3])
def test_join_with_zero_alone_does_not_hang():
    """ZeRO as the only joinable gives the notices itself; a joined rank still steps and
    broadcasts its partition, so every rank ends with the same parameters."""
    g, rank, n = world()
    model = build("mlp", seed=0)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    with Join([zero]):
        for step in range(2 + rank):
            x, y = batch("mlp", step, 3 * n)
            loss_fn("mlp", model(mine(x, rank)), mine(y, rank)).backward()
            zero.step()
            zero.zero_grad()
    for name, p in model.named_parameters():
        assert_synced(p.detach(), g, name=name)


@distributed([2])
def test_user_errors_name_the_fix():
    model = build("mlp", seed=0)
    with pytest.raises(ValueError, match="empty parameter list"):
        ZeroRedundancyOptimizer([], torch.optim.AdamW)
    with pytest.raises(TypeError, match="iterable of Tensors"):
        ZeroRedundancyOptimizer(model.fc1.weight, torch.optim.AdamW)
    with pytest.raises(ValueError, match="one dense type"):
        ZeroRedundancyOptimizer([model.fc1.weight, model.fc2.weight.double()], torch.optim.AdamW)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match="to=2 is not a rank"):
        zero.consolidate_state_dict(to=2)
    with pytest.raises(ValueError, match="2 parameter groups in the state dict|has 2 parameter groups"):
        zero.load_state_dict({"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]})


def port(source: str) -> str:
    """The porting rule, applied to import lines only."""
    rules = (("torch.distributed.optim", "plait.optim"), ("torch.nn.parallel", "plait.ddp"))
    lines = []
    for line in source.splitlines(keepends=True):
        if line.startswith(("from ", "import ")):
            for old, new in rules:
                line = line.replace(old, new)
        lines.append(line)
    return "".join(lines)


def test_recipe_port_changes_only_imports():
    here = Path(__file__).parent
    torch_src = (here / "recipe_zero_torch.py").read_text()
    assert port(torch_src) != torch_src
    assert port(torch_src) == (here / "recipe_zero_plait.py").read_text()


def run_recipe(module, rank, use_zero):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.example(rank, 2, use_zero)
    return out.getvalue().splitlines()


@distributed([2])
def test_torchs_recipe_prints_torchs_numbers():
    """pytorch/tutorials' ZeroRedundancyOptimizer recipe, run with torch's imports and with
    plait's: the same memory figures (bytes counted exactly) and the same parameter sum (atol
    1e-3 on a sum of ~800k parameters of |p| < 0.08, whose rounding is ~1e-4: the DDPs all-reduce
    in different buckets, and Adam's first step is lr * sign(g) almost everywhere)."""
    g, rank, n = world()
    for use_zero in (True, False):
        ours, theirs = run_recipe(recipe_zero_plait, rank, use_zero), run_recipe(recipe_zero_torch, rank, use_zero)
        assert [line for line in ours if "memory" in line] == [line for line in theirs if "memory" in line]
        total = [float(line.split(": ")[1]) for line in ours + theirs if line.startswith("params sum is")]
        assert len(total) == 2 and abs(total[0] - total[1]) < 1e-3, total
        if rank == 0:
            after_step = float(re.search(r"after optimizer step\(\): ([\d.]+)MB", "\n".join(ours)).group(1))
            if use_zero:
                zero_after = after_step
            else:
                # 804k parameters: params + grads 6.43 MB; Adam's state 6.43 MB whole, half with ZeRO on 2 ranks
                assert zero_after == pytest.approx(after_step - 6.432 / 2, abs=1e-3), (zero_after, after_step)
