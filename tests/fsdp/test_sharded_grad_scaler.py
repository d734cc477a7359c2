"""ShardedGradScaler: the same fp16 loop on torch's fully_shard + torch's ShardedGradScaler
and on plait's (imports changed only), and the one thing a sharded scaler must add to
GradScaler: an inf in one rank's piece of a gradient skips the step on every rank.

Loop: fully_shard per block and root with param_dtype=float16, reduce_dtype=float32,
SGD, growth_interval=2 (the scale grows during the test), loss scaled, and at step 2 an
inf written into rank 1's local piece of one gradient (the other ranks' pieces are finite).

Tolerance: losses rtol 1e-3 and parameters atol 1e-4. Both libraries compute the same fp16
forward and backward and reduce in float32; fp16 keeps 11 significant bits, so a different
order of the reduction's adds moves a loss by a few 1e-4 relative at most; a wrong unscale
(a factor of 2**16) or a step not skipped would be off by far more.
"""

import torch
import torch.nn.functional as F
from torch import nn

from plait.testing import distributed
from tests.fsdp.common import MLP, PER_RANK, batch, global_mean, mine, world

STEPS, INF_STEP = 5, 2


def _first_nonempty_grad(model: nn.Module):
    """The first parameter whose local piece is not empty on this rank."""
    for p in model.parameters():
        if p.grad is not None and p.grad.to_local().numel():
            return p
    raise AssertionError("no gradient piece on this rank")


def _train(api: str, n: int, rank: int, *, inf_rank: int):
    if api == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    else:
        from plait.device_mesh import init_device_mesh
        from plait.fsdp import MixedPrecisionPolicy, fully_shard
        from plait.fsdp.sharded_grad_scaler import ShardedGradScaler
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    model = MLP()
    mp = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    losses, scales, skipped = [], [], []
    for step in range(STEPS):
        x, y = batch("mlp", step, n * PER_RANK)
        loss = F.cross_entropy(model(mine(x, rank)).float(), mine(y, rank))
        scaler.scale(loss).backward()
        if step == INF_STEP and rank == inf_rank:
            _first_nonempty_grad(model).grad.to_local().view(-1)[0] = float("inf")
        before = [p.detach().to_local().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters())))
        opt.zero_grad()
        losses.append(global_mean(loss, _group()))
        scales.append(scaler.get_scale())
    full = [p.full_tensor().detach() for p in model.parameters()]
    return losses, scales, skipped, full


def _group():
    from plait import comm

    return comm.world_group()


@distributed([2])
def test_inf_on_one_rank_skips_the_step_everywhere_as_torch():
    _, rank, n = world()
    ours = _train("plait", n, rank, inf_rank=1)
    theirs = _train("torch", n, rank, inf_rank=1)
    losses, scales, skipped, full = ours
    # init 2**10, growth_interval 2: grows after steps 0-1, backs off at the inf step 2,
    # then two good steps (3, 4) grow it again -- on every rank, not only on rank 1
    assert scales == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11], scales
    assert skipped == [False, False, True, False, False], skipped
    torch.testing.assert_close(losses, theirs[0], rtol=1e-3, atol=1e-4)
    assert scales == theirs[1] and skipped == theirs[2]
    for a, b in zip(full, theirs[3]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@distributed([2])
def test_plain_sharded_grads_sync_found_inf():
    """FSDP1-style plain flat shards (no DTensor): rank 0's grads are finite, rank 1's not;
    both skip, and without the sync (torch's own GradScaler) rank 0 would step."""
    from plait.fsdp.sharded_grad_scaler import ShardedGradScaler

    _, rank, n = world()
    flat = nn.Parameter(torch.arange(4.0) + rank)  # this rank's shard of a flat parameter
    opt = torch.optim.SGD([flat], lr=1.0)
    scaler = ShardedGradScaler("cpu", init_scale=4.0)
    scaler.scale(flat.sum()).backward()  # grad = 4 (the scale) everywhere
    if rank == 1:
        flat.grad[2] = float("nan")
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(flat.detach(), torch.arange(4.0) + rank)  # skipped on both ranks
    assert scaler.get_scale() == 2.0
    opt.zero_grad()
    scaler.scale(flat.sum()).backward()  # a good step now: grads 2 (the scale), unscaled to 1
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(flat.detach(), torch.arange(4.0) + rank - 1.0)


def test_disabled_and_defaults_match_torch():
    import inspect

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as Theirs

    from plait.fsdp.sharded_grad_scaler import ShardedGradScaler

    ours = inspect.signature(ShardedGradScaler.__init__).parameters
    theirs = inspect.signature(Theirs.__init__).parameters
    assert list(ours) == list(theirs)
    for name in ours:
        if name not in ("self", "process_group"):
            assert ours[name].default == theirs[name].default, name
    scaler = ShardedGradScaler("cpu", enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss and not scaler.is_enabled()
