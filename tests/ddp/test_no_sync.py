"""Gradient accumulation: k micro-steps under no_sync plus one synced step equal one
step on the concatenated batch of all of them (each micro-loss scaled by 1/k).

No gradient is reduced inside no_sync (all-reduces counted with CommDebugMode), the accumulated local
gradients differ across ranks until the synced step, and after it they are the average.
Tolerances as in test_parity (rounding of differently ordered sums: ~1e-7 relative).
"""

import pytest
import torch

from plait.ddp import DistributedDataParallel, replicate
from plait.debug import CommDebugMode
from plait.testing import assert_synced, distributed
from tests.ddp.common import (
    PER_RANK,
    assert_params_close,
    batch,
    build,
    loss_fn,
    make_optimizer,
    world,
)

MICRO = 3


def micro(x, y, rank, k):
    """Rank `rank`'s k-th micro-batch of the global batch."""
    at = (rank * MICRO + k) * PER_RANK
    return x[at:at + PER_RANK], y[at:at + PER_RANK]


@distributed([1, 2, 3])
@pytest.mark.parametrize("front", ["ddp-copy", "ddp-view", "replicate-view"])
def test_no_sync_accumulation_equals_one_big_step(front):
    g, rank, n = world()
    model, ref = build("mlp", seed=rank), build("mlp", seed=0)
    view = front.endswith("view")
    if front.startswith("ddp"):
        dp = DistributedDataParallel(model, bucket_cap_mb=0.0005, gradient_as_bucket_view=view)
        no_sync = dp.no_sync
    else:
        dp = replicate(model, bucket_cap_mb=0.0005, gradient_as_bucket_view=view)
        no_sync = dp.no_sync
    opt, ref_opt = make_optimizer("adamw", dp.parameters()), make_optimizer("adamw", ref.parameters())
    for step in range(3):
        x, y = batch("mlp", step, n * MICRO * PER_RANK)
        with CommDebugMode() as counts, no_sync():
            for k in range(MICRO - 1):
                xk, yk = micro(x, y, rank, k)
                (loss_fn("mlp", dp(xk), yk) / MICRO).backward()
        assert counts.get_comm_counts()["all_reduce"] == 0, counts.get_comm_counts()  # (a rebuild's broadcast may run)
        if n > 1:
            with pytest.raises(AssertionError, match="differs"):
                assert_synced(model.fc1.weight.grad, g)
        xk, yk = micro(x, y, rank, MICRO - 1)
        (loss_fn("mlp", dp(xk), yk) / MICRO).backward()
        loss_fn("mlp", ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_synced(p.grad, g, name=name)
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=step == 0), ref_opt.zero_grad()
    assert_params_close(model, ref, atol=2e-5, rtol=1e-4, what="no_sync accumulation")


@distributed([2])
def test_set_requires_gradient_sync_and_require_backward_grad_sync():
    """replicate's switch and the DDP attribute HF Accelerate sets both skip communication."""
    g, rank, n = world()
    x = torch.randn(PER_RANK, 6) + rank
    dp = replicate(build("mlp", seed=0))
    dp.set_requires_gradient_sync(False)
    with CommDebugMode() as counts:
        dp(x).sum().backward()
    assert counts.get_total_counts() == 0
    dp.set_requires_gradient_sync(True)
    dp(x).sum().backward()
    assert_synced(dp.fc1.weight.grad, g)
    ddp = DistributedDataParallel(build("mlp", seed=0))
    ddp.require_backward_grad_sync = False
    with CommDebugMode() as counts:
        ddp(x).sum().backward()
    assert counts.get_total_counts() == 0
