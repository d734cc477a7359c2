"""Activation checkpointing under fully_shard (the order docs/DESIGN.md gives: AC, then FSDP):
checkpoint each block, fully_shard each (wrapped) block and the root, and train like one
process without checkpointing (the parity protocol of tests/fsdp/common.py; tolerances
as in tests/fsdp/test_parity.py: loss rtol 1e-5, parameters atol 2e-5 / rtol 1e-4, from
the reduce-scatter's order of summation). The recompute in backward needs the block's
gathered parameters, which its pre-backward all-gather provides.
"""

import torch
import torch.nn.functional as F

from plait.activation_checkpointing import CheckpointWrapper, apply_activation_checkpointing
from plait.fsdp import fully_shard
from plait.testing import distributed
from tests.fsdp.common import PER_RANK, Block, batch, build, global_mean, make_opt, mine, world

STEPS = 4


@distributed([2, 3])
def test_checkpointed_blocks_under_fully_shard():
    g, rank, n = world()
    model, ref = build("mlp"), build("mlp")
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    assert all(isinstance(b, CheckpointWrapper) for b in model.blocks)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    assert list(model.state_dict()) == list(ref.state_dict())
    calls = []
    for b in model.blocks:
        b._checkpoint_wrapped_module.register_forward_pre_hook(lambda m, a: calls.append(1))
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(STEPS):
        x, y = batch("mlp", step, n * PER_RANK)
        loss = F.cross_entropy(model(mine(x, rank)), mine(y, rank))
        loss.backward()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        torch.testing.assert_close(global_mean(loss, g), ref_loss.item(), rtol=1e-5, atol=1e-6)
    assert len(calls) == 2 * 2 * STEPS  # every block: forward, then the recompute in backward
    sd = model.state_dict()
    for name, p in ref.state_dict().items():
        got = sd[name].full_tensor() if hasattr(sd[name], "full_tensor") else sd[name]
        torch.testing.assert_close(got, p, atol=2e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
