"""Parity: DistributedDataParallel and replicate train exactly like one process on the
concatenated global batch (see tests/ddp/common.py for the protocol).

World sizes 1-4; 5 steps of SGD (momentum) or AdamW; an MLP, a CNN with BatchNorm
(buffers broadcast from rank 0), a GPT with tied input/output embeddings; both front
doors; gradient_as_bucket_view on and off; both ways of zeroing gradients; caps small
enough that every model has several buckets, and replicas that start from different
seeds (the start-up broadcast must make them rank 0's).

Tolerances (float32): loss rtol 1e-5; parameters atol 2e-5, rtol 1e-4. DDP adds the
ranks' gradients (each scaled by 1/N first) in another order than the reference's one
backward over the whole batch, so the two differ by rounding, ~1e-7 relative per step;
five steps of AdamW (which divides by sqrt(v) and so magnifies the relative error of
small gradients) stay well inside these bounds, while a missing or doubled gradient
contribution would be off by 1/N. Replicas must agree with each other exactly: every
rank receives the same all-reduced bits and applies the same optimizer step.
"""

import pytest
import torch

from plait.ddp import DistributedDataParallel, replicate
from plait.ddp.replicate import replicate_state
from plait.testing import assert_synced, distributed
from tests.ddp.common import (
    PER_RANK,
    Mixed,
    assert_params_close,
    batch,
    build,
    global_mean,
    loss_fn,
    make_optimizer,
    mine,
    reference_loss,
    world,
)

STEPS = 5
BUCKET_MB = {"mlp": 0.0005, "cnn_bn": 0.00005, "gpt": 0.004}  # several buckets per model
CASES = {  # model, front door, optimizer, gradient_as_bucket_view
    "mlp-ddp-sgd": ("mlp", "ddp", "sgd", False),
    "mlp-replicate-adamw-view": ("mlp", "replicate", "adamw", True),
    "cnn_bn-ddp-sgd-view": ("cnn_bn", "ddp", "sgd", True),
    "cnn_bn-replicate-adamw": ("cnn_bn", "replicate", "adamw", False),
    "gpt_tied-ddp-adamw": ("gpt", "ddp", "adamw", False),
    "gpt_tied-replicate-sgd-view": ("gpt", "replicate", "sgd", True),
}


@distributed([1, 2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_single_process(case):
    kind, front, opt_name, view = CASES[case]
    g, rank, n = world()
    model, ref = build(kind, seed=rank), build(kind, seed=0)
    kwargs = dict(bucket_cap_mb=BUCKET_MB[kind], gradient_as_bucket_view=view)
    if front == "ddp":
        dp = DistributedDataParallel(model, **kwargs)
        reducer = dp.reducer
    else:
        dp = replicate(model, **kwargs)
        reducer = dp._replicate_state.reducer
    assert len(reducer.buckets) >= 2, reducer.buckets
    assert_params_close(model, ref, atol=0, rtol=0, what="after the start-up broadcast")
    opt, ref_opt = make_optimizer(opt_name, dp.parameters()), make_optimizer(opt_name, ref.parameters())
    for step in range(STEPS):
        x, y = batch(kind, step, n * PER_RANK)
        loss = loss_fn(kind, dp(mine(x, rank)), mine(y, rank))
        loss.backward()
        if view:  # the .grads are the buckets' views: nothing was copied out
            for bucket in reducer.buckets:
                for p, v in zip(bucket.params, bucket.views):
                    assert p.grad.data_ptr() == v.data_ptr(), bucket.fqns
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        ref_loss = reference_loss(kind, ref, x, y, n)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(global_mean(loss, g), ref_loss.item(), rtol=1e-5, atol=1e-7,
                                   msg=f"loss at step {step}")
    assert reducer.has_rebuilt
    assert_params_close(model, ref, atol=2e-5, rtol=1e-4, what=f"after {STEPS} steps")
    for name, p in model.named_parameters():
        assert_synced(p, g, name=name)
    if rank == 0:  # rank 0's buffers are everyone's, and moved with its slice only
        for (name, b), rb in zip(model.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, rb, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"buffer {name}: {m}")


@distributed([1, 2, 3])
def test_bf16_parameters_get_bf16_buckets():
    """A bfloat16 layer between float32 ones: buckets hold one dtype each and bf16 is
    reduced in bf16. Tolerance: the reference rounds to bf16 (u = 2^-8) at other points of
    the same sums, so gradients agree to a few u of the largest gradient: atol 2^-5 x max,
    rtol 2^-5; a missing or doubled rank (>= 1/4 of the value for N <= 4) is far outside."""
    g, rank, n = world()
    torch.manual_seed(rank)
    model = Mixed()
    torch.manual_seed(0)
    ref = Mixed()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0003)
    dtypes = [b.buffer.dtype for b in ddp.reducer.buckets]
    assert set(dtypes) == {torch.float32, torch.bfloat16}
    assert all(len({p.dtype for p in b.params}) == 1 for b in ddp.reducer.buckets)
    opt, ref_opt = make_optimizer("sgd", ddp.parameters()), make_optimizer("sgd", ref.parameters())
    for step in range(3):
        x, y = batch("mlp", step, n * PER_RANK)
        loss_fn("mlp", ddp(mine(x, rank)), mine(y, rank)).backward()
        loss_fn("mlp", ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad.dtype == p.dtype
            scale = q.grad.abs().max().item()
            torch.testing.assert_close(p.grad, q.grad, atol=2**-5 * scale, rtol=2**-5,
                                       msg=lambda m, name=name, step=step: f"step {step} {name}: {m}")
            q.grad.copy_(p.grad)  # continue from the same point: compare one step at a time
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        for name, p in model.named_parameters():
            assert_synced(p, g, name=name)


class _KeepsLogits(torch.nn.Module):
    """Returns its logits detached and keeps the live ones: the loss reaches the parameters
    through a tensor the forward kept, not through the outputs (no output pre-hook fires)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = build("mlp", seed=0)
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.kept = self.mlp(x)
        return self.kept.detach()


@distributed([1, 2, 3])
@pytest.mark.parametrize("front", ["ddp", "replicate"])
def test_loss_through_a_kept_tensor_is_reduced_like_one_through_the_outputs(front):
    """The first gradient, not the outputs' pre-hook, begins the backward: every bucket
    (several) is still reduced and the step matches one process (tolerances as above)."""
    g, rank, n = world()
    module = _KeepsLogits()
    torch.manual_seed(rank)
    for p in module.parameters():  # replicas that start apart: the start-up broadcast aligns them
        p.data.normal_()
    wrapped = (DistributedDataParallel(module, bucket_cap_mb=BUCKET_MB["mlp"]) if front == "ddp"
               else replicate(module, bucket_cap_mb=BUCKET_MB["mlp"]))
    ref = _KeepsLogits()
    ref.load_state_dict(module.state_dict())
    reducer = wrapped.reducer if front == "ddp" else replicate_state(wrapped).reducer
    assert len(reducer.buckets) > 1
    opt, ref_opt = make_optimizer("adamw", wrapped.parameters()), make_optimizer("adamw", ref.parameters())
    for step in range(3):
        x, y = batch("mlp", step, n * PER_RANK)
        wrapped(mine(x, rank))
        loss_fn("mlp", module.kept, mine(y, rank)).backward()
        ref(x)
        loss_fn("mlp", ref.kept, y).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_params_close(module, ref, atol=2e-5, rtol=1e-4, what=f"kept-tensor loss ({front})")
    for name, p in module.named_parameters():
        assert_synced(p, g, name=name)
