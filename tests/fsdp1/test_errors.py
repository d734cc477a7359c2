"""Bad input to FullyShardedDataParallel fails at construction, before any collective,
with the module and what to do; ignored modules stay whole; model.module and
fsdp_modules are torch's."""

import functools

import pytest
import torch
from torch import nn

from plait.device_mesh import init_device_mesh
from plait.fsdp import (
    FullStateDictConfig,
    MixedPrecision,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
    fully_shard,
)
from plait.fsdp import (
    FullyShardedDataParallel as FSDP,
)
from plait.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from plait.tensor import DTensor
from plait.testing import distributed
from tests.fsdp.common import build
from tests.fsdp1.common import units, wrap


@distributed([2])
def test_bad_input():
    with pytest.raises(ValueError, match=r"wraps no submodule with parameters of MLP \(484 parameters\)"):
        FSDP(build("mlp"), auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                              transformer_layer_cls={nn.Conv2d}))
    with pytest.raises(ValueError, match="min_num_params"):
        FSDP(build("mlp"), auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=10**6))
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        with pytest.raises(ValueError, match=f"{strategy.name} needs a 2-D layout"):
            FSDP(build("mlp"), sharding_strategy=strategy)
        with pytest.raises(ValueError, match="needs a 2-D \\(replicate, shard\\) device_mesh; got a 1-D"):
            FSDP(build("mlp"), sharding_strategy=strategy, device_mesh=init_device_mesh("cpu", (2,)))
    with pytest.raises(ValueError, match="takes a 1-D device_mesh"):
        FSDP(build("mlp"), device_mesh=init_device_mesh("cpu", (1, 2)))
    with pytest.raises(TypeError, match=r"MixedPrecision\(buffer_dtype=torch.int64\) must be a floating dtype"):
        FSDP(build("mlp"), mixed_precision=MixedPrecision(buffer_dtype=torch.int64))
    model = wrap(build("mlp"))
    with pytest.raises(ValueError, match="MLP is already sharded"):
        FSDP(model)
    with pytest.raises(ValueError, match="Block is already sharded"):
        FSDP(fully_shard(build("mlp").blocks[0]))
    inner = build("mlp")
    inner.blocks[0] = FSDP(inner.blocks[0])
    with pytest.raises(ValueError, match="submodule 'blocks.0' is sharded already"):
        wrap(inner)
    with pytest.raises(ValueError, match="not both"):
        FSDP(build("mlp"), ignored_modules=[], ignored_states=[])
    with pytest.raises(ValueError, match="process_group or device_mesh, not both"):
        FSDP(build("mlp"), process_group=object(), device_mesh=init_device_mesh("cpu", (2,)))
    with pytest.raises(ValueError, match="FULL_STATE_DICT takes a state_dict_config of type FullStateDictConfig"):
        FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT, ShardedStateDictConfig())
    with pytest.raises(TypeError, match="ShardingStrategy"):
        FSDP(build("mlp"), sharding_strategy="FULL_SHARD")


@distributed([2])
def test_manual_nesting_ignored_modules_and_helpers():
    model, ref = build("mlp"), build("mlp")
    for i, b in enumerate(model.blocks):  # wrapping by hand, children first, as FSDP1 scripts do
        model.blocks[i] = FSDP(b, use_orig_params=True)  # (the flat parameter's: test_flat_param.py)
    model = FSDP(model, ignored_modules=[model.head], use_orig_params=True)
    assert units(model) == ["MLP", "Block", "Block"]
    assert [type(u.module).__name__ for u in FSDP.fsdp_modules(model, root_only=True)] == ["MLP"]
    assert type(model.head.weight) is nn.Parameter and not isinstance(model.head.weight, DTensor)
    assert isinstance(model.inp.weight, DTensor)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        assert list(model.state_dict()) == list(ref.state_dict())
    # ignored parameters are not synchronised (torch's rule): freeze them, train the rest
    import torch.nn.functional as F

    from tests.fsdp.common import PER_RANK, batch, global_mean, make_opt, mine, world

    g, rank, n = world()
    for m in (model, ref):
        m.head.requires_grad_(False)
    opts = [make_opt([p for p in m.parameters() if p.requires_grad]) for m in (model, ref)]
    for step in range(3):
        x, y = batch("mlp", step, n * PER_RANK)
        loss = F.cross_entropy(model(mine(x, rank)), mine(y, rank))
        ref_loss = F.cross_entropy(ref(x), y)
        for lo, o in zip((loss, ref_loss), opts):
            lo.backward()
            o.step()
            o.zero_grad()
        torch.testing.assert_close(global_mean(loss, g), ref_loss.item(), rtol=1e-5, atol=1e-6)
