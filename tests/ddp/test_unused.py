"""Unused parameters: find_unused_parameters, static_graph, and the error without them.

Parity as in test_parity (same tolerances, same reasons): the reference averages each
rank slice's loss computed with that rank's choice of branch, which is exactly the loss
whose gradient DDP's average is. A parameter no rank used keeps its `.grad` (None here,
as in the reference); one that only some ranks used gets the average over all ranks.
"""

import pytest
import torch

from plait.ddp import DistributedDataParallel
from plait.testing import assert_synced, distributed
from tests.ddp.common import (
    PER_RANK,
    Branchy,
    SharedCheckpointed,
    TwoHeads,
    assert_params_close,
    batch,
    build,
    loss_fn,
    make_optimizer,
    mine,
    world,
)


def uses_aux(step: int, rank: int, n: int) -> bool:
    """Step 0 all ranks, 1 none, 2 rank 0 only, 3 all but rank 0 (none on 1 rank), 4 all."""
    return [True, False, rank == 0, rank != 0, True][step]


@distributed([1, 2, 3, 4])
def test_find_unused_parameters_branch_unused_on_some_iterations_and_ranks():
    g, rank, n = world()
    model, ref = build("branchy", seed=rank), build("branchy", seed=0)
    ddp = DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.0002)
    opt, ref_opt = make_optimizer("adamw", ddp.parameters()), make_optimizer("adamw", ref.parameters())
    for step in range(5):
        x, y = batch("branchy", step, n * PER_RANK)
        loss = loss_fn("branchy", ddp(mine(x, rank), use_aux=uses_aux(step, rank, n)), mine(y, rank))
        loss.backward()
        ref_loss = torch.stack([loss_fn("branchy", ref(mine(x, r), use_aux=uses_aux(step, r, n)), mine(y, r))
                                for r in range(n)]).mean()
        ref_loss.backward()
        if not any(uses_aux(step, r, n) for r in range(n)):
            assert model.aux.weight.grad is None and ref.aux.weight.grad is None, "globally unused: untouched"
        else:
            torch.testing.assert_close(model.aux.weight.grad, ref.aux.weight.grad, atol=1e-6, rtol=1e-5)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_params_close(model, ref, atol=2e-5, rtol=1e-4, what="find_unused_parameters")
    for name, p in model.named_parameters():
        assert_synced(p, g, name=name)


@distributed([2, 3])
def test_find_unused_parameters_output_left_out_of_the_loss_and_no_sync():
    """`side_head` is reachable from the outputs but the loss ignores it on odd steps; and
    a parameter used only in a no_sync micro-step still has its gradient reduced."""
    g, rank, n = world()
    torch.manual_seed(rank)
    model = TwoHeads()
    torch.manual_seed(0)
    ref = TwoHeads()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    for step in range(4):
        x, y = batch("mlp", step, 2 * n * PER_RANK)
        xs, ys = x.chunk(2), y.chunk(2)  # micro-step 0 under no_sync, 1 synced
        with ddp.no_sync():
            main, side = ddp(mine(xs[0], rank))
            (loss_fn("mlp", main, mine(ys[0], rank)) + loss_fn("mlp", side, mine(ys[0], rank))).backward()
        main, side = ddp(mine(xs[1], rank))
        use_side = step % 2 == 0
        (loss_fn("mlp", main, mine(ys[1], rank)) + (loss_fn("mlp", side, mine(ys[1], rank)) if use_side else 0)).backward()
        ref_main, ref_side = ref(xs[0])
        ref_loss = loss_fn("mlp", ref_main, ys[0]) + loss_fn("mlp", ref_side, ys[0])
        ref_main, ref_side = ref(xs[1])
        ref_loss = ref_loss + loss_fn("mlp", ref_main, ys[1]) + (loss_fn("mlp", ref_side, ys[1]) if use_side else 0)
        ref_loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad, q.grad = None, None


@distributed([1, 2, 3])
def test_static_graph_reentrant_checkpoint_and_never_used_parameter():
    """static_graph counts how often each gradient arrives (twice for the shared layer,
    inside two reentrant backward passes) and marks the never-used parameter ready."""
    g, rank, n = world()
    torch.manual_seed(rank)
    model = SharedCheckpointed()
    torch.manual_seed(0)
    ref = SharedCheckpointed()
    ddp = DistributedDataParallel(model, static_graph=True, bucket_cap_mb=0.0002)
    opt, ref_opt = make_optimizer("sgd", ddp.parameters()), make_optimizer("sgd", ref.parameters())
    for step in range(4):
        x, y = batch("mlp", step, n * PER_RANK)
        loss_fn("mlp", ddp(mine(x, rank)), mine(y, rank)).backward()
        loss_fn("mlp", ref(x), y).backward()
        assert model.never_used.weight.grad is None
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert ddp.reducer.has_rebuilt
    assert_params_close(model, ref, atol=2e-5, rtol=1e-4, what="static_graph")


@distributed([2])
def test_gradient_arriving_twice_without_static_graph_names_the_parameter():
    ddp = DistributedDataParallel(SharedCheckpointed())
    with pytest.raises(RuntimeError, match=r"shared\.(weight|bias) got its gradient twice.*static_graph=True"):
        ddp(torch.randn(2, 6)).sum().backward()


@distributed([2, 3])
def test_unused_parameter_without_the_flag_raises_on_the_next_forward_never_hangs():
    g, rank, n = world()
    x = torch.randn(PER_RANK, 6)
    # every rank leaves `aux` out: every rank raises at the next forward
    ddp = DistributedDataParallel(Branchy())
    ddp(x).sum().backward()
    ddp(x, use_aux=False).sum().backward()  # completes: the aux bucket goes out as zeros
    with pytest.raises(RuntimeError, match=r"\['aux\.weight', 'aux\.bias'\].*find_unused_parameters=True"):
        ddp(x)
    # only rank 0 uses it: the backward completes on every rank (no rank waits on a bucket
    # another never sends); the ranks that did not use it raise at their next forward
    ddp = DistributedDataParallel(Branchy())
    ddp(x, use_aux=rank == 0).sum().backward()
    if rank == 0:
        assert ddp.reducer._error is None
    else:
        with pytest.raises(RuntimeError, match=r"on rank \d, parameters \['aux\.weight', 'aux\.bias'\]"):
            ddp(x)


class CheckpointedTail(torch.nn.Module):
    """The last layers run in a reentrant checkpoint: their gradients (the first to be
    ready) arrive inside a nested backward that ends before the first layer's does."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 8)
        self.tail = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.tail, self.first(x), use_reentrant=True)


@distributed([2])
def test_end_of_backward_is_the_outer_backward_and_outputs_stay_plain():
    g, rank, n = world()
    torch.manual_seed(0)
    model, ref = CheckpointedTail(), CheckpointedTail()
    ref.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0001)
    x, y = batch("mlp", 0, n * PER_RANK)
    out = ddp(mine(x, rank))
    out.mul_(2)  # in-place on an output: DDP returned the module's own tensors
    loss_fn("mlp", out, mine(y, rank)).backward()
    out = ref(x)
    out.mul_(2)
    loss_fn("mlp", out, y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
