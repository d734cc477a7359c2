"""MixedPrecisionPolicy, CPUOffloadPolicy and shard_placement_fn.

bf16: param_dtype=bfloat16, reduce_dtype=float32. The reference casts the same way: a
bfloat16 copy of the float32 master parameters (buffers stay float32, as FSDP leaves them),
inputs cast to bfloat16 at every FSDP module's entry, one backward per rank's slice (as
each rank computes it), the slices' bfloat16 gradients summed in float32 in rank order
and divided by N, then float32 AdamW on the masters. Every op then sees the same operands
in the same dtype as on the FSDP ranks, so the only difference left is the order of the
float32 sum over ranks inside the reduce-scatter: tolerances are float32-sized (loss rtol
1e-5 of a bfloat16 loss, parameters atol 1e-5), not bfloat16-sized — a gradient reduced
in bfloat16 or a parameter stepped in bfloat16 would be off by ~1e-3.
"""

import pytest
import torch
import torch.nn.functional as F

from plait.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from plait.tensor import DTensor, Shard
from plait.testing import chunk_sizes, distributed
from tests.fsdp.common import (
    PER_RANK,
    assert_full_params_close,
    batch,
    build,
    global_mean,
    make_opt,
    mine,
    shard,
    slices_to_reference,
    train_parity,
    world,
)

BF16 = torch.bfloat16


def _reference_bf16_step(ref, x, y, n):
    """One step of the reference: returns the mean loss; leaves float32 grads on `ref`."""
    low = build("mlp")
    low.load_state_dict(ref.state_dict())
    for p in low.parameters():
        p.data = p.data.to(BF16)
    for block in low.blocks:
        block.register_forward_pre_hook(lambda mod, args: tuple(a.to(BF16) for a in args))
    return slices_to_reference(ref, low, lambda r: F.cross_entropy(low(mine(x, r).to(BF16)), mine(y, r)), n)


@distributed([1, 2, 3])
def test_bf16_mixed_precision_parity():
    g, rank, n = world()
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    model, ref = shard(build("mlp"), mp_policy=mp), build("mlp")
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(10):
        x, y = batch("mlp", step, n * PER_RANK)
        out = model(mine(x, rank))
        assert out.dtype == BF16  # output_dtype=None: the compute dtype comes out
        loss = F.cross_entropy(out, mine(y, rank))
        loss.backward()
        ref_loss = _reference_bf16_step(ref, x, y, n)
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        torch.testing.assert_close(global_mean(loss, g), ref_loss, rtol=1e-5, atol=1e-6)
    assert_full_params_close(model, ref, atol=1e-5, rtol=1e-5, what="bf16 after 10 steps")
    state = opt.state[next(iter(model.parameters()))]
    assert state["exp_avg"].dtype == torch.float32
    model.unshard()  # after unshard() the module's parameters are in param_dtype
    assert model.inp.weight.dtype == BF16 and not isinstance(model.inp.weight, DTensor)
    model.reshard()


@distributed([2])
def test_output_dtype_and_no_input_cast():
    _, rank, n = world()
    model = build("mlp")
    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=BF16))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=BF16, output_dtype=torch.float32))
    assert model(torch.randn(2, 7)).dtype == torch.float32
    model.blocks[0]._plait_fsdp_state.mp_policy = MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=False)
    with pytest.raises(RuntimeError):  # a float32 input meets bfloat16 weights uncast
        model.blocks[0](torch.randn(2, 13))


@distributed([1, 2, 3])
def test_cpu_offload_policy():
    _, rank, n = world()
    model, ref = shard(build("mlp"), offload_policy=CPUOffloadPolicy(pin_memory=True)), build("mlp")
    for p in model.parameters():
        assert p._local_tensor.device.type == "cpu"
        assert not p._local_tensor.is_pinned()  # pinning needs a CUDA device to copy to
    train_parity("mlp", model, ref, steps=10)
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what="offload after 10 steps")
    for p in model.parameters():
        assert p.grad is None or p.grad._local_tensor.device.type == "cpu"


@distributed([2, 3, 4])
def test_shard_placement_fn_shard_dim_1():
    _, rank, n = world()
    model, ref = build("mlp"), build("mlp")
    shard(model, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    for name, p in model.named_parameters():
        dim = 1 if p.dim() == 2 else 0
        assert p.placements == (Shard(dim),), name
        assert p._local_tensor.size(dim) == chunk_sizes(p.size(dim), n)[rank], name  # 7, 13, 11 uneven
    train_parity("mlp", model, ref, steps=10)
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what="Shard(1) after 10 steps")


@distributed([2, 3])
def test_bf16_gradient_accumulation_keeps_reduce_dtype():
    """Without gradient sync, unsharded bfloat16 gradients accumulate in reduce_dtype
    (float32) between micro-steps, as torch documents; the reference adds each rank's
    micro-step gradients in float32 in the same order (rank by rank, then over ranks)."""
    _, rank, n = world()
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    model, ref = shard(build("mlp"), mp_policy=mp), build("mlp")
    micro = 3
    per_rank = [{name: torch.zeros_like(p) for name, p in ref.named_parameters()} for _ in range(n)]
    for k in range(micro):
        model.set_requires_gradient_sync(k == micro - 1)
        x, y = batch("mlp", k, n * PER_RANK)
        F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
        for r in range(n):
            _reference_bf16_step(ref, mine(x, r), mine(y, r), 1)
            for name, p in ref.named_parameters():
                per_rank[r][name] += p.grad
                p.grad = None
    theirs = {name: sum(per_rank[r][name] for r in range(n)) / n for name in per_rank[0]}
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.full_tensor(), theirs[name], atol=1e-6, rtol=1e-5,
                                   msg=lambda m, name=name: f"accumulated gradient of {name}: {m}")
