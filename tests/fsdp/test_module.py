"""FSDPModule's methods: unshard/reshard by hand (sync and async), gradient accumulation
without gradient sync (with and without resharding between micro-steps), the reshard
setters, set_is_last_backward, default and explicit prefetch (the peak number of groups
unsharded at once). Parity is against one process on the whole batch (common.py); with
accumulation the reference sums the micro-steps' gradients the same way."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.debug import CommDebugMode
from plait.fsdp import fully_shard
from plait.tensor import DTensor
from plait.testing import distributed
from tests.fsdp.common import (
    PER_RANK,
    Block,
    assert_full_params_close,
    assert_grads_close,
    batch,
    build,
    make_opt,
    mine,
    shard,
    world,
)


class Deep(nn.Module):
    def __init__(self, depth: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 9)
        self.blocks = nn.ModuleList([Block(9, 9) for _ in range(depth)])
        self.head = nn.Linear(9, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _deep(seed: int = 0) -> Deep:
    torch.manual_seed(seed)
    return Deep()


@distributed([2, 3])
def test_unshard_and_reshard_by_hand():
    _, rank, n = world()
    model, ref = shard(build("mlp")), build("mlp")
    for async_op in (False, True):
        handle = model.unshard(async_op=async_op)
        if async_op:
            assert handle is not None
            handle.wait()
        else:
            assert handle is None
        w = model.inp.weight
        assert not isinstance(w, DTensor) and tuple(w.shape) == (13, 7)
        torch.testing.assert_close(w.detach(), ref.inp.weight, atol=0, rtol=0)
        assert isinstance(model.blocks[0].lin.weight, DTensor)  # another group: still sharded
        with CommDebugMode() as mode:
            model(torch.randn(2, 7))  # the root is unsharded already: only the blocks gather
        assert mode.get_comm_counts()["all_gather"] == 2
        model.reshard()
        assert isinstance(model.inp.weight, DTensor)
        model.reshard()  # already sharded: nothing to do


@distributed([2, 3])
@pytest.mark.parametrize("reshard_between", [True, False], ids=["reshard", "stay_unsharded"])
def test_gradient_accumulation_without_sync(reshard_between):
    _, rank, n = world()
    model, ref = shard(build("mlp"), reshard_after_forward=reshard_between), build("mlp")
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    micro = 3
    for step in range(4):
        for k in range(micro):
            last = k == micro - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(reshard_between or last)
            x, y = batch("mlp", 10 * step + k, n * PER_RANK)
            with CommDebugMode() as mode:
                F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
                F.cross_entropy(ref(x), y).backward()
            counts = mode.get_comm_counts()
            assert counts["reduce_scatter"] == (3 if last else 0), (k, dict(counts))
            if not reshard_between and k > 0:  # the blocks stayed unsharded: no re-gather
                assert counts["all_gather"] == 0, (k, dict(counts))
        assert_grads_close(model, ref, atol=1e-6, rtol=1e-4, what=f"step {step}")
        assert all(isinstance(p, DTensor) for p in model.parameters())
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what="after accumulation")


@distributed([2])
def test_is_last_backward_false_leaves_reductions_to_the_next_forward():
    _, rank, n = world()
    model, ref = shard(build("mlp")), build("mlp")
    for k in range(3):
        model.set_is_last_backward(k == 2)
        x, y = batch("mlp", k, n * PER_RANK)
        F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
        F.cross_entropy(ref(x), y).backward()
        pending = model._plait_fsdp_state.ctx.queue.pending
        assert (len(pending) == 0) == (k == 2), (k, len(pending))
    assert_grads_close(model, ref, atol=1e-6, rtol=1e-4, what="three synced micro-steps")


@distributed([2])
def test_set_reshard_after_forward():
    _, rank, n = world()
    model = shard(build("mlp"), reshard_after_forward=True)
    x, y = batch("mlp", 0, n * PER_RANK)
    for reshard, gathers in ((True, 6), (False, 3)):
        model.set_reshard_after_forward(reshard)
        with CommDebugMode() as mode:
            F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
        assert mode.get_comm_counts()["all_gather"] == gathers, (reshard, dict(mode.get_comm_counts()))


def _watch_prefetch(model: Deep, seen: list) -> None:
    """Record, as each block starts computing, which later blocks are gathered or in flight."""
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        def check(mod, args, i=i):
            ready = [j for j, b in enumerate(blocks) if j > i and (b._plait_fsdp_state.group.is_unsharded
                                                                    or b._plait_fsdp_state.group.gather_pending)]
            seen.append((i, ready))
        block.register_forward_pre_hook(check)  # runs after fully_shard's own pre-hook


def _watch_backward(model: Deep, seen: list) -> None:
    """Record, as each block's backward starts, which groups are gathered and which
    reduce-scatters are still in flight."""
    blocks = list(model.blocks)
    ctx = model._plait_fsdp_state.ctx

    def on_output(mod, args, out, i):
        def grad_hook(grad):  # runs after fully_shard's pre-backward hook on the same output
            gathered = [j for j, b in enumerate(blocks) if b._plait_fsdp_state.group.is_unsharded
                        or b._plait_fsdp_state.group.gather_pending]
            seen.append((i, gathered, [blocks.index(_block_of(model, g)) for g, _ in ctx.queue.pending]))
            return grad
        out.register_hook(grad_hook)

    for i, block in enumerate(blocks):
        block.register_forward_hook(lambda mod, args, out, i=i: on_output(mod, args, out, i))


def _block_of(model: Deep, group):
    return next(b for b in model.blocks if b._plait_fsdp_state.group is group)


@distributed([2, 3])
@pytest.mark.parametrize("explicit", [False, True], ids=["default", "explicit"])
def test_prefetch_and_peak_unsharded_groups(explicit):
    _, rank, n = world()
    model, ref = _deep(), _deep()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    blocks = list(model.blocks)
    if explicit:  # two ahead in forward, one ahead in backward
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
            block.set_modules_to_backward_prefetch(blocks[max(i - 1, 0):i][::-1])
    seen: list = []
    back: list = []
    _watch_prefetch(model, seen)
    _watch_backward(model, back)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    ctx = model._plait_fsdp_state.ctx
    for step in range(4):
        seen.clear()
        back.clear()
        ctx.peak_unsharded = 0
        x, y = batch("mlp", step, n * PER_RANK)
        F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
        F.cross_entropy(ref(x), y).backward()
        assert_grads_close(model, ref, atol=1e-6, rtol=1e-4, what=f"step {step}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        if step == 0 and not explicit:
            continue  # the default forward prefetch follows the previous step's order
        ahead = 2 if explicit else 1
        for i, ready in seen:  # the next block(s) were being gathered before this one computed
            assert ready == list(range(i + 1, min(i + 1 + ahead, len(blocks)))), (step, i, ready)
        assert ctx.peak_unsharded == ahead + 1, (step, ctx.peak_unsharded)
        last = len(blocks) - 1
        for i, gathered, in_flight in back:  # backward runs blocks last to first
            assert gathered == list(range(max(i - 1, 0), i + 1)), (step, i, gathered)  # this + the next
            assert in_flight == ([] if i == last else [i + 1]), (step, i, in_flight)  # overlaps this one
        assert [i for i, _, _ in back] == list(range(last, -1, -1)), back
        assert all(isinstance(p, DTensor) for p in model.parameters())
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what="after prefetching")


class Checkpointed(Deep):
    """Every block under non-reentrant activation checkpointing: its forward runs again
    inside backward, where the group must stay unsharded and reduce once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.head(h)


@distributed([2, 3])
def test_activation_checkpointing_inside_blocks():
    _, rank, n = world()
    torch.manual_seed(0)
    model = Checkpointed()
    ref = _deep()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(4):
        x, y = batch("mlp", step, n * PER_RANK)
        with CommDebugMode() as mode:
            F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
        counts = mode.get_comm_counts()  # the recompute gathers nothing more
        assert counts["all_gather"] == 1 + 2 * len(model.blocks) and counts["reduce_scatter"] == 6, dict(counts)
        F.cross_entropy(ref(x), y).backward()
        assert_grads_close(model, ref, atol=1e-6, rtol=1e-4, what=f"step {step}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what="checkpointed")


@distributed([2])
def test_register_fsdp_forward_method():
    from plait.fsdp import register_fsdp_forward_method

    _, rank, n = world()
    model, ref = build("mlp"), build("mlp")
    for m in (model, ref):
        m.score = lambda x, m=m: m.head(m.inp(x) @ torch.ones(13, 13) / 13)  # a method besides forward
    fully_shard(model, reshard_after_forward=True)
    register_fsdp_forward_method(model, "score")
    x = torch.randn(4, 7)
    torch.testing.assert_close(model.score(x), ref.score(x))
    assert isinstance(model.inp.weight, DTensor)  # the post-forward hook ran: resharded
    with pytest.raises(ValueError, match="not an FSDPModule"):
        register_fsdp_forward_method(nn.Linear(2, 2), "forward")


@distributed([2])
def test_two_forwards_before_one_backward():
    """Each forward's backward reaches a block through that forward's output hook, which
    gathers the group again if the other forward's backward already resharded it; the
    two reduce-scatters add up in the sharded .grad."""
    _, rank, n = world()
    model, ref = shard(build("mlp")), build("mlp")
    (x, y), (x2, y2) = batch("mlp", 0, n * PER_RANK), batch("mlp", 1, n * PER_RANK)
    loss = F.cross_entropy(model(mine(x, rank)), mine(y, rank)) + F.cross_entropy(model(mine(x2, rank)), mine(y2, rank))
    loss.backward()
    (F.cross_entropy(ref(x), y) + F.cross_entropy(ref(x2), y2)).backward()
    assert_grads_close(model, ref, atol=1e-6, rtol=1e-4, what="two forwards, one backward")
    assert all(isinstance(p, DTensor) for p in model.parameters())
