"""ZeroRedundancyOptimizer(overlap_with_ddp=True): the step runs per DDP bucket inside backward,
driven by ddp_zero_hook; it trains as overlap_with_ddp=False does, and as torch's overlap does.

Protocol (tests/ddp/common.py): step t's global batch from seed t, rank r trains on slice r. The
MLP's six parameters (72, 12, 144, 12, 36, 3 elements) fall into 3 DDP buckets of >= 200 bytes,
so ranks own 2 + 1 buckets (world 2) or one each (world 3); with shard_buckets a bucket can be
split over ranks. Iterations 0 and 1 do not step (torch: DDP's buckets are final only then), so
the references skip their step() there.

Tolerances (float32). Against overlap_with_ddp=False: exact. Both DDPs reduce with the same hook
in the same buckets, and AdamW is elementwise per tensor, so stepping a bucket's slice computes
the very bits the whole step computes. Against torch's DDP + ZeRO overlap: atol 1e-6 / rtol 1e-5,
because torch's DDP sums its first iteration in other buckets (Gloo rounding, as test_zero.py).
torch's hooks refuse Gloo; its hook_with_zero_step issues every collective from the autograd
thread in bucket order and runs on Gloo once the check is lifted (torch_hook_on_gloo). Its
interleaved hook does hang on Gloo (broadcasts from Gloo's worker threads), so plait's interleaved
hook is compared with torch's hook_with_zero_step: the same update, in another schedule.
"""

import contextlib
import logging
import types
import warnings
from types import MethodType

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook as torch_zero_hook
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.distributed.optim.zero_redundancy_optimizer import _OverlapInfo, _OverlapStatus
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from plait.algorithms.ddp_comm_hooks import ddp_zero_hook
from plait.ddp import DistributedDataParallel, Join
from plait.ddp.comm_hooks.default_hooks import allreduce_hook, fp16_compress_wrapper
from plait.debug import CommDebugMode
from plait.optim import ZeroRedundancyOptimizer
from plait.optim.zero_overlap import assign_bucket_slices
from plait.testing import assert_synced, distributed
from tests.ddp.common import assert_params_close, batch, build, loss_fn, mine, world

STEPS = 6
WARMUP = 2  # iterations that do not step
ADAMW = dict(lr=1e-2, weight_decay=0.1)
EXACT = dict(atol=0.0, rtol=0.0)
NEAR_TORCH = dict(atol=1e-6, rtol=1e-5)
CAP_MB = 200 / 2**20  # 3 buckets of the MLP
HOOKS = {"zero_step": ddp_zero_hook.hook_with_zero_step,
         "interleaved": ddp_zero_hook.hook_with_zero_step_interleaved}


@contextlib.contextmanager
def torch_hook_on_gloo():
    """Build torch's hook past its Gloo check (the check runs at construction only)."""
    class _Dist(types.ModuleType):
        def __getattr__(self, name):
            return getattr(dist, name)

        @staticmethod
        def get_backend(group=None):
            return dist.Backend.NCCL

    saved = torch_zero_hook.dist
    torch_zero_hook.dist = _Dist("torch.distributed")
    try:
        yield
    finally:
        torch_zero_hook.dist = saved


def forward_backward(ddp, step, rank, n):
    x, y = batch("mlp", step, 3 * n)
    loss = loss_fn("mlp", ddp(mine(x, rank)), mine(y, rank))
    loss.backward()
    return loss.detach()


def overlapped(model, kind="zero_step", shard_buckets=False):
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, overlap_with_ddp=True, **ADAMW)
    ddp.register_comm_hook(None, HOOKS[kind](allreduce_hook, ddp, zero, shard_buckets=shard_buckets))
    return ddp, zero


# -- the partition: torch's rule, without processes ---------------------------------------


def torch_slices(numels, world_size, shard_buckets):
    """torch's own `_bucket_assignments_per_rank`, run on stand-in buckets."""
    fake = types.SimpleNamespace(_overlap_with_ddp=True, world_size=world_size, global_rank=0,
                                 _bucket_assignments_per_rank_cache=[])
    info = _OverlapInfo(world_size)
    info.status, info.shard_buckets = _OverlapStatus.INITIALIZED, shard_buckets
    info.params_per_bucket = [[torch.empty(k) for k in bucket] for bucket in numels]
    info.total_size = sum(map(sum, numels))
    fake._overlap_info = info
    for name in ("_get_min_index", "_assign_bucket_subset_to_rank", "_get_assigned_rank"):
        setattr(fake, name, MethodType(getattr(TorchZeRO, name), fake))
    per_rank = TorchZeRO._bucket_assignments_per_rank.fget(fake)
    return [[(k, a.offset, a.offset + len(a.parameters)) for k, a in mine_.items()] for mine_ in per_rank]


@pytest.mark.parametrize("shard_buckets", [False, True], ids=["whole", "sharded"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bucket_slices_follow_torchs_rule(world_size, shard_buckets):
    gen = torch.Generator().manual_seed(world_size)
    compared = 0
    for _ in range(20):
        numels = [torch.randint(1, 50, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
                  for _ in range(int(torch.randint(1, 7, (1,), generator=gen)))]
        ours = assign_bucket_slices(numels, world_size, shard_buckets)
        pieces = sorted(piece for mine_ in ours for piece in mine_)
        for k, bucket in enumerate(numels):  # each bucket covered once, at most one slice per rank
            cuts = [(a, b) for j, a, b in pieces if j == k]
            assert cuts[0][0] == 0 and cuts[-1][1] == len(bucket), (numels, ours)
            assert all(b == a2 for (_, b), (a2, _) in zip(cuts, cuts[1:])), (numels, ours)
            assert all(len({j for j, _, _ in mine_ if j == k}) == sum(j == k for j, _, _ in mine_) for mine_ in ours)
        try:
            expected = torch_slices(numels, world_size, shard_buckets)
        except AssertionError as e:  # torch cut a bucket into more slices than ranks
            assert "All indices are disallowed" in str(e)
            continue
        assert ours == expected, numels
        compared += 1
    assert compared >= 15  # torch fails only where a bucket would need more slices than ranks


def test_sharded_slices_by_hand():
    # total 23 over 2 ranks: threshold 11.5; buckets smallest first: 1 (2), 2 (9), 0 (12, cut at 8)
    assert assign_bucket_slices([[4, 4, 4], [2], [8, 1]], 2, True) == [[(1, 0, 1), (0, 0, 2)], [(2, 0, 2), (0, 2, 3)]]
    assert assign_bucket_slices([[4], [2], [8]], 2, False) == [[(0, 0, 1), (2, 0, 1)], [(1, 0, 1)]]


# -- training parity --------------------------------------------------------------------


@distributed([2, 3])
@pytest.mark.parametrize("shard_buckets", [False, True], ids=["whole", "sharded"])
@pytest.mark.parametrize("kind", list(HOOKS))
def test_matches_zero_after_backward_and_torchs_overlap(kind, shard_buckets):
    g, rank, n = world()
    ours, ref, theirs = build("mlp", seed=0), build("mlp", seed=0), build("mlp", seed=0)
    ddp, zero = overlapped(ours, kind, shard_buckets)
    ref_ddp = DistributedDataParallel(ref, bucket_cap_mb=CAP_MB)
    ref_ddp.register_comm_hook(None, allreduce_hook)  # the same reduction bits as the overlap's
    ref_zero = ZeroRedundancyOptimizer(ref_ddp.parameters(), torch.optim.AdamW, **ADAMW)
    torch_ddp = TorchDDP(theirs, bucket_cap_mb=CAP_MB)
    torch_zero = TorchZeRO(torch_ddp.parameters(), torch.optim.AdamW, overlap_with_ddp=True, **ADAMW)
    with torch_hook_on_gloo():
        torch_ddp.register_comm_hook(None, torch_zero_hook.hook_with_zero_step(
            torch_default_hooks.allreduce_hook, torch_ddp, torch_zero, shard_buckets=shard_buckets))
    initial = [p.detach().clone() for p in ours.parameters()]
    for step in range(STEPS):
        loss = forward_backward(ddp, step, rank, n)
        zero.zero_grad()
        expected = forward_backward(ref_ddp, step, rank, n)
        if step >= WARMUP:
            ref_zero.step()
        ref_zero.zero_grad()
        torch_loss = forward_backward(torch_ddp, step, rank, n)
        torch_zero.zero_grad()
        torch.testing.assert_close(loss, expected, **EXACT, msg=lambda m, step=step: f"loss at step {step}: {m}")
        torch.testing.assert_close(loss, torch_loss, **NEAR_TORCH, msg=lambda m, step=step: f"vs torch, {step}: {m}")
        if step == WARMUP - 1:  # the warm-up iterations moved nothing
            for p, q in zip(ours.parameters(), initial):
                torch.testing.assert_close(p.detach(), q, **EXACT)
    assert_params_close(ours, ref, **EXACT, what=f"{kind} overlap vs ZeRO after backward")
    assert_params_close(ours, theirs, **NEAR_TORCH, what=f"{kind} overlap vs torch's overlap")
    for name, p in ours.named_parameters():
        assert_synced(p.detach(), g, name=name)
    assert len(ddp.reducer.buckets) == 3
    owned = [sum(p.numel() for g_ in groups for p in g_["params"]) for groups in zero._partition_parameters()]
    assert sum(owned) == 279 and all(owned), owned  # every parameter owned once, every rank owns some
    # the whole state, consolidated, is the after-backward ZeRO's
    zero.consolidate_state_dict(to=0)
    ref_zero.consolidate_state_dict(to=0)
    if rank == 0:
        ours_sd, ref_sd = zero.state_dict(), ref_zero.state_dict()
        assert ours_sd["param_groups"] == ref_sd["param_groups"]
        torch.testing.assert_close(ours_sd["state"], ref_sd["state"], **EXACT)


@distributed([2])
def test_static_graph_bucket_view_grads_compressed_hook_and_a_scheduler():
    """static_graph: three iterations without a step (torch's count; torch 2.13 checked by hand,
    its DDP rebuilds a static graph's buckets after iteration 2); gradient_as_bucket_view; a
    wrapped hook that swaps the bucket's buffer; SGD with momentum; an LR scheduler on the
    outer param_groups. Against ZeRO after backward with the same DDP: exact (see the top)."""
    g, rank, n = world()
    warmup, sgd = 3, dict(lr=0.1, momentum=0.9)
    options = dict(bucket_cap_mb=CAP_MB, static_graph=True, gradient_as_bucket_view=True)
    hook = fp16_compress_wrapper(allreduce_hook)
    ours, ref = build("mlp", seed=0), build("mlp", seed=0)
    ddp, ref_ddp = DistributedDataParallel(ours, **options), DistributedDataParallel(ref, **options)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, **sgd)
    ddp.register_comm_hook(None, ddp_zero_hook.hook_with_zero_step_interleaved(hook, ddp, zero))
    ref_ddp.register_comm_hook(None, hook)
    ref_zero = ZeroRedundancyOptimizer(ref_ddp.parameters(), torch.optim.SGD, **sgd)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (zero, ref_zero)]
    theirs = build("mlp", seed=0)
    torch_ddp = TorchDDP(theirs, bucket_cap_mb=CAP_MB, static_graph=True)
    torch_zero = TorchZeRO(torch_ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True, **sgd)
    with torch_hook_on_gloo():
        torch_ddp.register_comm_hook(None, torch_zero_hook.hook_with_zero_step(
            torch_default_hooks.allreduce_hook, torch_ddp, torch_zero))
    initial = [p.detach().clone() for p in ours.parameters()]
    for step in range(STEPS):
        loss = forward_backward(ddp, step, rank, n)
        zero.zero_grad()
        expected = forward_backward(ref_ddp, step, rank, n)
        if step >= warmup:
            ref_zero.step()
        ref_zero.zero_grad()
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": ours never calls it
            warnings.simplefilter("ignore", UserWarning)
            for schedule in schedules:
                schedule.step()
        torch.testing.assert_close(loss, expected, **EXACT, msg=lambda m, step=step: f"loss at step {step}: {m}")
        forward_backward(torch_ddp, step, rank, n)
        torch_zero.zero_grad()
        moved = [any(not torch.equal(p.detach(), q) for p, q in zip(m.parameters(), initial)) for m in (ours, theirs)]
        assert moved == [step >= warmup] * 2, (step, moved)  # plait and torch start stepping together
    assert_params_close(ours, ref, **EXACT, what="static graph overlap vs ZeRO after backward")
    # the local optimizer takes the outer lr at each step, in backward: one schedule step behind here
    assert (zero.param_groups[0]["lr"], zero.optim.param_groups[0]["lr"]) == (0.1 * 0.5**STEPS, 0.1 * 0.5**(STEPS - 1))


@distributed([2, 3])
def test_load_state_dict_reaches_every_bucket_step():
    """A state loaded after the partition exists is what the per-bucket steps use: both ZeROs
    load the same edited state (momentum halved) and must go on alike (exact, see the top)."""
    g, rank, n = world()
    ours, ref = build("mlp", seed=0), build("mlp", seed=0)
    ddp, zero = overlapped(ours, "interleaved")
    ref_ddp = DistributedDataParallel(ref, bucket_cap_mb=CAP_MB)
    ref_ddp.register_comm_hook(None, allreduce_hook)
    ref_zero = ZeroRedundancyOptimizer(ref_ddp.parameters(), torch.optim.AdamW, **ADAMW)

    def train(steps):
        for step in steps:
            forward_backward(ddp, step, rank, n)
            zero.zero_grad()
            forward_backward(ref_ddp, step, rank, n)
            if step >= WARMUP:
                ref_zero.step()
            ref_zero.zero_grad()

    train(range(WARMUP + 2))
    ref_zero.consolidate_state_dict(to=0)
    state = [ref_zero.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(state, src=0, group=g)
    for entry in state[0]["state"].values():
        entry["exp_avg"].mul_(0.5)
    zero.load_state_dict(state[0])
    ref_zero.load_state_dict(state[0])
    train(range(WARMUP + 2, STEPS))
    assert_params_close(ours, ref, **EXACT, what="after load_state_dict")
    zero.consolidate_state_dict(to=0)
    ref_zero.consolidate_state_dict(to=0)
    if rank == 0:
        torch.testing.assert_close(zero.state_dict()["state"], ref_zero.state_dict()["state"], **EXACT)


# -- where the collectives go -------------------------------------------------------------


@distributed([2, 3])
@pytest.mark.parametrize("kind", list(HOOKS))
def test_broadcasts_happen_inside_backward_in_bucket_order(kind):
    """Warm-up backwards all-reduce only; then each backward also broadcasts every bucket (one
    owner each), after all all-reduces (zero_step) or one bucket behind them (interleaved);
    step() issues nothing."""
    g, rank, n = world()
    ddp, zero = overlapped(build("mlp", seed=0), kind)
    for step in range(STEPS):
        x, y = batch("mlp", step, 3 * n)
        loss = loss_fn("mlp", ddp(mine(x, rank)), mine(y, rank))
        with CommDebugMode() as mode:
            loss.backward()
        ops = [e.op for e in mode.events]
        buckets = len(ddp.reducer.buckets)
        if step < WARMUP:
            assert ops == ["all_reduce"] * buckets, (step, ops)
        elif kind == "zero_step":
            assert ops == ["all_reduce"] * buckets + ["broadcast"] * buckets, ops
        else:
            assert ops == ["all_reduce"] + ["all_reduce", "broadcast"] * (buckets - 1) + ["broadcast"], ops
        if step >= WARMUP:  # bucket k's slice from its owner, k % n, the whole bucket's numel
            casts = [(e.peer, e.input_shapes[0]) for e in mode.events if e.op == "broadcast"]
            assert casts == [(k % n, (b.buffer.numel(),)) for k, b in enumerate(ddp.reducer.buckets)], casts
        with CommDebugMode() as mode:
            assert zero.step() is None
        assert mode.get_total_counts() == 0
        zero.zero_grad()
    assert buckets == 3


# -- errors, as torch's where torch has one ------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def zero_log():
    handler, logger = _Records(), logging.getLogger("plait.optim.zero_redundancy_optimizer")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


@distributed([2])
def test_user_errors_name_the_fix():
    g, rank, n = world()
    model = build("mlp", seed=0)
    with pytest.raises(ValueError, match="NAdam is not one of torch's functional optimizers"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.NAdam, overlap_with_ddp=True)
    groups = [{"params": [model.fc1.weight]}, {"params": [model.fc2.weight]}]
    with pytest.raises(ValueError, match="one parameter group.*got 2"):
        ZeroRedundancyOptimizer(groups, torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    plain = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="must be constructed with `overlap_with_ddp=True`"):
        ddp_zero_hook.hook_with_zero_step(allreduce_hook, ddp, plain)
    with zero_log() as messages:
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, parameters_as_bucket_view=True,
                                       overlap_with_ddp=True, lr=0.1)
    assert any("parameters_as_bucket_view=True is ignored" in m for m in messages), messages
    with pytest.raises(RuntimeError, match="no DDP comm hook drives it"):
        zero.step()
    with pytest.raises(RuntimeError, match="no local optimizer until .* third backward"):
        zero.consolidate_state_dict()
    with pytest.raises(RuntimeError, match="cannot join"):
        Join([ddp, zero])
    unused = DistributedDataParallel(build("mlp", seed=0), find_unused_parameters=True)
    with pytest.raises(ValueError, match="find_unused_parameters=True it never rebuilds"):
        ddp_zero_hook.hook_with_zero_step_interleaved(
            allreduce_hook, unused,
            ZeroRedundancyOptimizer(unused.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1))
    ddp.register_comm_hook(None, ddp_zero_hook.hook_with_zero_step(allreduce_hook, ddp, zero))
    with pytest.raises(RuntimeError, match="already built"):
        ddp_zero_hook.hook_with_zero_step(allreduce_hook, ddp, zero)
    for step in range(WARMUP + 1):
        forward_backward(ddp, step, rank, n)
        with zero_log() as messages:
            zero.step()
        assert any("should not be in the training loop" in m for m in messages), messages
        zero.zero_grad()
    with pytest.raises(RuntimeError, match="one parameter group"):
        zero.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
