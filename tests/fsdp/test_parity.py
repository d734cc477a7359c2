"""Parity: fully_shard per block + root trains like one process (protocol in common.py).

World sizes 1-4 (dims 7, 13, 11, 5 divide by none of 2, 3, 4: every parameter is padded),
reshard_after_forward True, False and torch's default (None: all but the root), 4 steps of
AdamW, a buffer in the forward, a weight tied between the input embedding and the head.

Tolerances (float32): loss rtol 1e-5; gradients (every step, gathered) atol 1e-6, rtol 1e-4;
parameters atol 2e-5, rtol 1e-4. The reduce-scatter
adds the ranks' gradients (each a mean over its slice) and divides by N, another order of
summation than the reference's one backward over the whole batch: ~1e-7 relative per step.
AdamW steps (which divide by sqrt(v) and so magnify the relative error of small
gradients) stay well inside the bounds (set when the test ran ten steps; four since: from
step 2 each step runs the same code with AdamW state), while a missing, doubled or misplaced shard of a
gradient would be off by O(1/N) at the first step.
"""

import pytest
import torch
from torch import nn

from plait.fsdp import FSDPModule
from plait.tensor import DTensor, Shard
from plait.testing import chunk_sizes, distributed
from tests.fsdp.common import assert_full_params_close, build, shard, train_parity, world

STEPS = 4


@distributed([1, 2, 3, 4])
@pytest.mark.parametrize("reshard", [True, False, None], ids=["reshard", "keep", "default"])
@pytest.mark.parametrize("kind", ["mlp", "tied"])
def test_parity_with_single_process(kind, reshard):
    _, rank, n = world()
    model, ref = build(kind), build(kind)
    shard(model, reshard_after_forward=reshard)
    assert isinstance(model, FSDPModule) and isinstance(model, type(ref))
    assert all(isinstance(b, FSDPModule) for b in model.blocks)
    for name, p in model.named_parameters():  # sharded, under the original names, nothing else
        assert isinstance(p, DTensor) and isinstance(p, nn.Parameter), name
        assert p.placements == (Shard(0),), name
        assert p._local_tensor.size(0) == chunk_sizes(p.size(0), n)[rank], name
    if kind == "tied":
        assert model.head.weight is model.emb.weight
    train_parity(kind, model, ref, steps=STEPS)
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what=f"after {STEPS} steps")
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, dict(ref.named_buffers())[name])


@distributed([2, 3])
def test_equals_plait_ddp():
    """The same slices through plait DDP and fully_shard give the same parameters."""
    import torch.nn.functional as F

    from plait.ddp import DistributedDataParallel
    from tests.fsdp.common import PER_RANK, batch, make_opt, mine

    _, rank, n = world()
    fsdp, plain = build("mlp"), build("mlp")
    shard(fsdp)
    ddp = DistributedDataParallel(plain)
    opts = [make_opt(fsdp.parameters()), make_opt(ddp.parameters())]
    for step in range(STEPS):
        x, y = batch("mlp", step, n * PER_RANK)
        for model, opt in zip((fsdp, ddp), opts):
            F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
            opt.step()
            opt.zero_grad()
    assert_full_params_close(fsdp, plain, atol=2e-5, rtol=1e-4, what="fully_shard vs DDP")


@distributed([2])
def test_original_parameters_are_freed():
    """After fully_shard only the shards hold parameter memory: nothing keeps the original
    nn.Parameters (or their storage) alive."""
    import gc
    import weakref

    model = build("mlp")
    originals = [weakref.ref(p) for p in model.parameters()]
    shard(model)
    gc.collect()
    assert all(ref() is None for ref in originals)
