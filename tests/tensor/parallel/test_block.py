"""A Megatron transformer block (tests/tensor/parallel/_block.py) parallelized with the
canonical plans communicates exactly as Megatron does, and trains like one process.

    TP alone   forward: one all-reduce after attention, one after the MLP; backward: the
               matching two (each region's colwise input grads add up before one)
    TP+SP      an all-gather before and a reduce-scatter after each region instead, in
               forward and (reversed) in backward

Parity: 5 AdamW steps of the block and of one process on the same data: losses every
step and full_tensor() parameters at the end, tp 1, 2, 4 and 3 (6 heads, 12 dims), fp32
and bf16, TP and TP+SP (norm weights Replicate with Partial gradients under SP).
Tolerances: fp32 1e-5 (the sharded contractions sum in another order, then AdamW's
normalized update keeps relative errors at that level); bf16 2e-2 on losses and 3e-2 on
parameters: bf16 keeps 8 significant bits (steps of 2^-8 relative), a sharded matmul
rounds each partial sum before the cross-rank reduction rounds again, and AdamW steps of
lr 1e-2 can move a weight by one bf16 step more or less.
"""

import pytest
import torch

from plait.debug import CommDebugMode
from plait.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
from plait.testing import distributed

from ._block import make_block, parallel_block

FP32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(loss=dict(atol=2e-2, rtol=2e-2), param=dict(atol=3e-2, rtol=3e-2))


def _mesh(world_size):
    return init_device_mesh("cpu", (world_size,))


def _inputs(mesh, x, sp: bool):
    """The block's input on this rank: the whole x (TP) or its sequence piece (TP+SP)."""
    return distribute_tensor(x, mesh, [Shard(1)]).to_local() if sp else x


def _full(out, mesh, sp: bool):
    return DTensor.from_local(out, mesh, [Shard(1)]).full_tensor() if sp else out


def _grad(p):
    return p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad


@distributed([2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_megatron_collectives(world_size, sp):
    mesh = _mesh(world_size)
    ref, block = make_block(), parallel_block(make_block(), mesh, sp)
    x = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(1))
    inp = _inputs(mesh, x, sp)
    with CommDebugMode() as fwd:
        out = block(inp)
    with CommDebugMode() as bwd:
        out.pow(2).sum().backward()
    want = {"all_gather": 2, "reduce_scatter": 2} if sp else {"all_reduce": 2}
    assert dict(fwd.get_comm_counts()) == want, fwd.get_comm_counts()
    assert dict(bwd.get_comm_counts()) == want, bwd.get_comm_counts()
    # ... and computes what one process does, forward and backward
    expected = ref(x)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(_full(out, mesh, sp), expected, **FP32)
    for (name, p), (_, q) in zip(block.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(_grad(p), q.grad, **FP32, msg=lambda m, name=name: f"{name}: {m}")
    if sp:  # the replicated norm weights: Partial grads (each rank's part of the sequence)
        assert block.attention_norm.weight.grad.placements[0].is_partial()


def _train(block, mesh, sp: bool, dtype, steps: int = 5):
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        x = torch.randn(2, 12, 12, generator=gen).to(dtype)
        y = torch.randn(2, 12, 12, generator=gen).to(dtype)
        out = block(_inputs(mesh, x, sp) if mesh is not None else x)
        target = _inputs(mesh, y, sp) if mesh is not None else y
        loss = (out.float() - target.float()).pow(2).sum()
        if sp:  # each rank holds part of the sequence: the loss is the sum of the parts
            loss = DTensor.from_local(loss.reshape(1), mesh, [Shard(0)]).full_tensor().sum()
        loss = loss / y.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


@distributed([1, 2, 3, 4], timeout=300)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_training_parity(world_size, sp, dtype):
    mesh = _mesh(world_size)
    heads = 6 if world_size == 3 else 4  # heads divide by the tp degree
    ref = make_block(12, heads, 24, dtype=dtype)
    block = parallel_block(make_block(12, heads, 24, dtype=dtype), mesh, sp)
    want, got = _train(ref, None, False, dtype), _train(block, mesh, sp, dtype)
    loss_tol, param_tol = (FP32, FP32) if dtype == torch.float32 else (BF16["loss"], BF16["param"])
    torch.testing.assert_close(got, want, **loss_tol)
    for (name, p), (_, q) in zip(block.named_parameters(), ref.named_parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(full.detach(), q.detach(), **param_tol, msg=lambda m, name=name: f"{name}: {m}")
