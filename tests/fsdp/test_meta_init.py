"""Meta-device initialisation: build under torch.device("meta"), fully_shard, to_empty,
then reset_parameters()/init_weights(). Every rank allocates only its shard (the local
tensors are torch.chunk pieces), and the parameters equal those of a model initialised
normally with the same seed: DTensor's random ops draw the single-process values and
keep each rank's piece (plait.tensor.ops.random_ops)."""

import torch

from plait.tensor import DTensor
from plait.testing import chunk_sizes, distributed
from tests.fsdp.common import MLP, assert_full_params_close, build, shard, train_parity, world


def init_weights(model: MLP) -> None:
    """What the model's constructor does, in the same order (the buffer too)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
    model.scale.copy_(torch.linspace(0.5, 1.5, 13))


@distributed([1, 2, 3, 4])
def test_meta_init_equals_normal_init():
    _, rank, n = world()
    with torch.device("meta"):
        model = MLP()
    shard(model)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        init_weights(model)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and not p.is_meta, name
        local = p._local_tensor
        assert local.size(0) == chunk_sizes(p.size(0), n)[rank], name
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), name  # the shard only
    ref = build("mlp", seed=0)
    assert_full_params_close(model, ref, atol=0, rtol=0, what="meta init")
    torch.testing.assert_close(model.scale, ref.scale)
    train_parity("mlp", model, ref, steps=3)
