"""The composable `checkpoint(module)` (torch.distributed._composable.checkpoint): in place,
names unchanged, the plain model's numbers, fewer saved activations — alone, against torch's
own composable checkpoint on the same seed, and under fully_shard (AC, then FSDP).

Tolerances: alone and against torch, bitwise (the recompute runs the same kernels in the same
order); under fully_shard as tests/fsdp/test_parity.py (loss rtol 1e-5, parameters atol 2e-5 /
rtol 1e-4, from the reduce-scatter's order of summation).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.activation_checkpointing import checkpoint
from plait.fsdp import fully_shard
from plait.testing import distributed
from tests.fsdp.common import PER_RANK, batch, build, global_mean, make_opt, mine, world


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    return out, total


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpoint_keeps_names_and_numbers_and_saves_less():
    plain, ckpt = _mlp(), _mlp()
    assert checkpoint(ckpt) is ckpt  # in place, as torch
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    x = torch.randn(16, 8)
    out_plain, plain_bytes = _saved_bytes(plain, x)
    out_ckpt, ckpt_bytes = _saved_bytes(ckpt, x)
    assert ckpt_bytes < plain_bytes / 2, (ckpt_bytes, plain_bytes)  # only the input survives forward
    out_plain.square().sum().backward()
    out_ckpt.square().sum().backward()
    assert torch.equal(out_plain, out_ckpt)
    for name, g in _grads(plain).items():
        assert torch.equal(_grads(ckpt)[name], g), name


def test_checkpoint_of_a_submodule_reruns_only_it_and_matches_torch():
    from torch.distributed._composable import checkpoint as torch_checkpoint

    ours, theirs = _mlp(), _mlp()
    checkpoint(ours[2])
    torch_checkpoint(theirs[2])
    runs = []
    ours[2].register_forward_pre_hook(lambda m, a: runs.append("ours"))
    x = torch.randn(16, 8)
    for model in (ours, theirs):
        model(x).square().sum().backward()
    assert runs == ["ours", "ours"]  # forward, then the recompute in backward
    for name, g in _grads(theirs).items():
        assert torch.equal(_grads(ours)[name], g), name


def test_checkpoint_refuses_reentrant_unknown_keywords_and_a_second_application():
    with pytest.raises(NotImplementedError, match="use_reentrant=True"):
        checkpoint(_mlp(), use_reentrant=True)
    with pytest.raises(ValueError, match="preserve_rng"):
        checkpoint(_mlp(), preserve_rng=False)
    model = checkpoint(_mlp())
    with pytest.raises(ValueError, match="already applied"):
        checkpoint(model)


def test_checkpoint_replays_dropout_with_the_forward_rng():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    ref = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    ref.load_state_dict(model.state_dict())
    checkpoint(model[1])
    x = torch.randn(32, 8)
    torch.manual_seed(1)
    model(x).sum().backward()
    torch.manual_seed(1)
    ref(x).sum().backward()
    for name, g in _grads(ref).items():
        assert torch.equal(_grads(model)[name], g), name


STEPS = 3


@distributed([2])
def test_composable_checkpoint_under_fully_shard():
    g, rank, n = world()
    model, ref = build("mlp"), build("mlp")
    for block in model.blocks:
        checkpoint(block)
        fully_shard(block)
    fully_shard(model)
    assert list(model.state_dict()) == list(ref.state_dict())
    runs = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, a: runs.append(1))
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
    assert len(runs) == 2 * len(model.blocks) * STEPS  # every block: forward, then its recompute
    sd = model.state_dict()
    for name, p in ref.state_dict().items():
        got = sd[name].full_tensor() if hasattr(sd[name], "full_tensor") else sd[name]  # buffers stay plain
        torch.testing.assert_close(got, p, atol=2e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
