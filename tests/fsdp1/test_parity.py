"""FullyShardedDataParallel trains like one process (the protocol and tolerances of
tests/fsdp/test_parity.py: loss rtol 1e-5, parameters atol 2e-5 / rtol 1e-4, gradients
every step atol 1e-6 / rtol 1e-4), 10 AdamW steps, at world sizes 2, 3, 4: every strategy
(HYBRID on 2 x 2), the three policy forms on the MLP whose dims divide by none of 2, 3, 4,
the reference Llama with the transformer policy, a tied weight, mixed precision against a
reference that casts the same way, CPU offload, sync_module_states and param_init_fn."""

import functools

import pytest
import torch
import torch.nn.functional as F

from plait.device_mesh import init_device_mesh
from plait.fsdp import (
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from plait.fsdp import (
    FullyShardedDataParallel as FSDP,
)
from plait.fsdp.wrap import transformer_auto_wrap_policy
from plait.tensor import DTensor, Replicate, Shard
from plait.testing import chunk_sizes, distributed
from tests.fsdp.common import (
    PER_RANK,
    assert_full_params_close,
    batch,
    build,
    global_mean,
    make_opt,
    mine,
    train_parity,
    world,
)
from tests.fsdp.test_policies import _reference_bf16_step
from tests.fsdp1.common import units, wrap

STEPS = 10
S = ShardingStrategy


def _parity(strategy):
    _, rank, n = world()
    model, ref = wrap(build("mlp"), sharding_strategy=strategy), build("mlp")
    assert units(model) == ["MLP", "Block", "Block"]
    assert isinstance(model.module, type(ref)) and model.module.head is model.head
    for name, p in model.named_parameters():  # the original names, each a shard
        assert isinstance(p, DTensor) and "_fsdp" not in name, name
        if strategy is S.NO_SHARD:
            assert p.placements == (Replicate(), Shard(0)) and p._local_tensor.shape == p.shape, name
        else:
            assert p._local_tensor.size(0) == chunk_sizes(p.size(0), n)[rank], name
    train_parity("mlp", model, ref, steps=STEPS)
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what=f"{strategy.name} after {STEPS} steps")


@distributed([2, 3, 4])
def test_full_shard_parity():
    _parity(S.FULL_SHARD)


@distributed([3])
@pytest.mark.parametrize("strategy", [S.SHARD_GRAD_OP, S.NO_SHARD], ids=lambda s: s.name)
def test_strategy_parity(strategy):
    _parity(strategy)


@distributed([3])
@pytest.mark.parametrize("policy, expected", [
    ("size", ["MLP", "Linear", "Linear"]),  # each Block's Linear reaches 150 first; the Block keeps 0
    ("module", ["MLP", "Block", "Block"]),
])
def test_policy_forms(policy, expected):
    model, ref = wrap(build("mlp"), policy), build("mlp")
    assert units(model) == expected
    train_parity("mlp", model, ref, steps=3)


@distributed([4])
@pytest.mark.parametrize("strategy", [S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2], ids=lambda s: s.name)
@pytest.mark.parametrize("how", ["mesh", "groups"])
def test_hybrid_2x2(strategy, how):
    _, rank, n = world()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    where = dict(device_mesh=mesh) if how == "mesh" else \
        dict(process_group=(mesh.get_group("shard"), mesh.get_group("replicate")))
    model, ref = wrap(build("mlp"), sharding_strategy=strategy, **where), build("mlp")
    for name, p in model.named_parameters():
        assert p.placements == (Replicate(), Shard(0)), name
        assert p._local_tensor.size(0) == chunk_sizes(p.size(0), 2)[mesh.get_local_rank("shard")], name
    train_parity("mlp", model, ref, steps=STEPS)
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what=strategy.name)


@distributed([2])
def test_llama_transformer_policy_tied():
    """The protocol and tolerances of tests/fsdp/test_llama.py (every element within 1e-3,
    95% within atol 1e-5 / rtol 1e-4: AdamW at lr 1e-2 magnifies reordered sums in a few
    small-gradient elements), with a tied embedding/output weight."""
    from plait.models.llama import TransformerBlock
    from tests.fsdp.test_llama import AFTER, _rows, train
    from tests.models.test_llama_tp import FP32, assert_params_match
    from tests.models.test_llama_tp import build as build_llama

    _, rank, n = world()
    ref, model = build_llama("tiny", tie=True), build_llama("tiny", tie=True)
    model = FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                           transformer_layer_cls={TransformerBlock}),
                 use_orig_params=True)
    assert units(model) == ["Transformer", "TransformerBlock", "TransformerBlock"]
    assert model.output.weight is model.tok_embeddings.weight
    losses, ref_losses = train(model, rows=_rows(rank, n)), train(ref, rows=None)
    mean = losses.clone()
    from plait import comm

    comm.all_reduce(mean, group=comm.world_group(), op="avg")
    torch.testing.assert_close(mean, ref_losses, **FP32["loss"])
    assert_params_match(model, ref, AFTER, "llama under FSDP")


@distributed([2, 3])
def test_bf16_mixed_precision_parity():
    """The reference of tests/fsdp/test_policies.py (bf16 copy, inputs cast at every unit,
    per-slice backward, float32 sum): cast_forward_inputs=True casts at every unit as
    fully_shard does. Tolerances float32-sized, as there."""
    g, rank, n = world()
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    model, ref = wrap(build("mlp"), mixed_precision=mp), build("mlp")
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(STEPS):
        x, y = batch("mlp", step, n * PER_RANK)
        loss = F.cross_entropy(model(mine(x, rank)), mine(y, rank))
        loss.backward()
        ref_loss = _reference_bf16_step(ref, x, y, n)
        assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        torch.testing.assert_close(global_mean(loss, g), ref_loss, rtol=1e-5, atol=1e-6)
    assert_full_params_close(model, ref, atol=1e-5, rtol=1e-5, what="bf16")


@distributed([2])
def test_buffer_dtype_and_root_input_cast():
    model = wrap(build("mlp"), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                              buffer_dtype=torch.bfloat16))
    assert model.scale.dtype == torch.bfloat16  # cast in the module
    assert model.state_dict()["scale"].dtype == torch.float32  # given back in its own dtype
    seen = []
    model.module.inp.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    model(torch.randn(3, 7)).sum().backward()
    assert seen == [torch.bfloat16, torch.bfloat16]  # the root cast; the block got bf16 anyway


@distributed([2])
def test_cpu_offload_parity():
    model, ref = wrap(build("mlp"), cpu_offload=CPUOffload(offload_params=True)), build("mlp")
    assert all(p.device.type == "cpu" for p in model.parameters())
    train_parity("mlp", model, ref, steps=STEPS)


@distributed([2, 3])
def test_sync_module_states_from_rank0():
    """Every rank builds different weights; sync_module_states makes them rank 0's."""
    _, rank, n = world()
    model, ref = build("mlp", seed=rank), build("mlp", seed=0)
    with torch.no_grad():
        model.scale.add_(rank)  # a buffer too
    model = wrap(model, sync_module_states=True)
    torch.testing.assert_close(model.scale, ref.scale, atol=0, rtol=0)
    assert_full_params_close(model, ref, atol=0, rtol=0, what="after sync")
    train_parity("mlp", model, ref, steps=3)


@distributed([2, 3])
def test_param_init_fn_from_meta():
    """Built on meta; param_init_fn materialises each module of each unit (once) from the
    reference's values; rank 0 only could hold them with sync_module_states (second case)."""
    from tests.fsdp.common import MLP

    _, rank, n = world()
    ref = build("mlp")
    with torch.device("meta"):
        model = MLP()
    source = {id(m): r for m, r in zip(model.modules(), ref.modules())}
    called = []

    def init(m):
        called.append(type(m).__name__)
        m.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for key, t in (*m._parameters.items(), *m._buffers.items()):
                if t is not None:
                    t.copy_(getattr(source[id(m)], key) if rank == 0 or not sync else torch.zeros_like(t))

    for sync in (False, True):
        with torch.device("meta"):
            model = MLP()
        source = {id(m): r for m, r in zip(model.modules(), ref.modules())}
        called.clear()
        model = wrap(model, param_init_fn=init, sync_module_states=sync)
        assert sorted(called) == sorted(["MLP", "Linear", "ModuleList", "Linear", "Block", "Linear", "Block",
                                         "Linear"]), called
        assert_full_params_close(model, ref, atol=0, rtol=0, what=f"meta init, sync={sync}")
    train_parity("mlp", model, ref, steps=3)


@distributed([2])
def test_activation_checkpointing_inside_units():
    """FSDP1 scripts apply activation checkpointing after wrapping: each unit's block is
    then a CheckpointWrapper; names, state dicts and numbers stay the plain model's."""
    from plait.activation_checkpointing import CheckpointWrapper, apply_activation_checkpointing
    from tests.fsdp.common import Block

    model, ref = wrap(build("mlp")), build("mlp")
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    assert all(isinstance(u.module, CheckpointWrapper) for u in FSDP.fsdp_modules(model)[1:])
    assert list(model.state_dict()) == list(ref.state_dict())
    train_parity("mlp", model, ref, steps=3)


class _BNBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.lin(x))


@distributed([2])
def test_batchnorm_units_keep_full_precision():
    """MixedPrecision._module_classes_to_ignore (torch's default: BatchNorm): with a policy,
    each BatchNorm becomes its own unit with mixed_precision=None, gathered in float32."""
    from plait.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(_BNBlock(), _BNBlock(), torch.nn.Linear(6, 2)),
                 auto_wrap_policy=ModuleWrapPolicy({_BNBlock}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=True))
    assert [(type(u.module).__name__, u.mixed_precision is None) for u in FSDP.fsdp_modules(model)] == [
        ("Sequential", False), ("_BNBlock", False), ("BatchNorm1d", True), ("_BNBlock", False),
        ("BatchNorm1d", True)]
    bn_units = [u for u in FSDP.fsdp_modules(model) if u.mixed_precision is None]
    assert all(u._state.group.param_dtype == torch.float32 for u in bn_units)
    model(torch.randn(4, 6)).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
