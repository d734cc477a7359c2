"""FullyShardedDataParallel's state dicts and optimizer state dicts, summon_full_params,
clip_grad_norm_ and no_sync.

FULL_STATE_DICT saved at world size 4 (rank0_only, offload_to_cpu) loads into the plain
model and into FSDP at world size 2 (exactly: a gathered tensor is the shards' bytes);
SHARDED and LOCAL round trips are exact; optimizer state through optim_state_dict /
optim_state_dict_to_load continues training bit for bit like the optimizer it came from.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from plait.debug import CommDebugMode
from plait.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictType,
)
from plait.fsdp import (
    FullyShardedDataParallel as FSDP,
)
from plait.tensor import DTensor
from plait.testing import distributed, run_distributed
from tests.fsdp.common import (
    PER_RANK,
    assert_full_params_close,
    batch,
    build,
    make_opt,
    mine,
    train_parity,
    world,
)
from tests.fsdp1.common import wrap

FULL, SHARDED, LOCAL = StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT


def _save_full(path: str) -> int:
    _, rank, n = world()
    model, ref = wrap(build("mlp")), build("mlp")
    train_parity("mlp", model, ref, steps=3)
    with FSDP.state_dict_type(model, FULL, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        sd = model.state_dict()
    assert FSDP.get_state_dict_type(model).state_dict_type is FULL  # the default again, as torch's
    if rank != 0:
        assert sd == {}
        return 0
    assert list(sd) == list(ref.state_dict())
    torch.save({"sd": sd, "ref": ref.state_dict()}, path)
    return len(sd)


def _load_full(path: str) -> None:
    saved = torch.load(path)
    model, ref = wrap(build("mlp", seed=7)), build("mlp", seed=7)
    with FSDP.state_dict_type(model, FULL):
        model.load_state_dict(saved["sd"])
    ref.load_state_dict(saved["sd"])
    assert_full_params_close(model, ref, atol=0, rtol=0, what="loaded at world size 2")
    torch.testing.assert_close(model.scale, saved["sd"]["scale"])
    train_parity("mlp", model, ref, steps=2)  # and trains on from there


def test_full_state_dict_world4_to_plain_and_world2(tmp_path):
    path = str(tmp_path / "full.pt")
    assert run_distributed(_save_full, path, world_size=4)[0] == 9
    saved = torch.load(path)
    plain = build("mlp", seed=3)
    plain.load_state_dict(saved["sd"])
    for k, v in saved["ref"].items():  # FSDP's trained values are the reference's
        torch.testing.assert_close(plain.state_dict()[k], v, atol=2e-5, rtol=1e-4)
    run_distributed(_load_full, path, world_size=2)


@distributed([3])
@pytest.mark.parametrize("kind", [SHARDED, LOCAL], ids=lambda k: k.name)
def test_sharded_and_local_round_trip(kind):
    _, rank, n = world()
    model, ref = wrap(build("mlp")), build("mlp")
    train_parity("mlp", model, ref, steps=2)
    config = ShardedStateDictConfig() if kind is SHARDED else LocalStateDictConfig()
    with FSDP.state_dict_type(model, kind, config):
        sd = {k: v.clone() if isinstance(v, DTensor) else v.detach().clone() for k, v in model.state_dict().items()}
    assert list(sd) == list(ref.state_dict())  # the original FQNs, no _fsdp_wrapped_module.
    params = dict(model.named_parameters())
    for k, p in params.items():
        if kind is SHARDED:
            assert isinstance(sd[k], DTensor) and sd[k].placements == p.placements and sd[k].shape == p.shape, k
        else:
            assert type(sd[k]) is torch.Tensor and sd[k].shape == p._local_tensor.shape, k
    other = wrap(build("mlp", seed=5))
    with FSDP.state_dict_type(other, kind, config):
        other.load_state_dict(sd)
    assert_full_params_close(other, model, atol=0, rtol=0, what=f"{kind.name} round trip")


@distributed([2])
@pytest.mark.parametrize("kind", [FULL, SHARDED], ids=lambda k: k.name)
def test_optim_state_dict_round_trip(kind):
    _, rank, n = world()
    model = wrap(build("mlp"))
    opt = make_opt(model.parameters())

    def step(m, o, t):
        x, y = batch("mlp", t, n * PER_RANK)
        F.cross_entropy(m(mine(x, rank)), mine(y, rank)).backward()
        o.step()
        o.zero_grad()

    for t in range(3):
        step(model, opt, t)
    configs = (FullStateDictConfig(), FullOptimStateDictConfig()) if kind is FULL else \
        (ShardedStateDictConfig(), ShardedOptimStateDictConfig())
    with FSDP.state_dict_type(model, kind, *configs):
        # cloned, as saving would: the values (the step counts at least) alias opt's state
        osd = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, FSDP.optim_state_dict(model, opt))
        with CommDebugMode() as mode:
            msd = model.state_dict()
    # FULL: one all-gather per unit (the engine's unshard), not one per parameter
    assert mode.get_comm_counts().get("all_gather", 0) == (3 if kind is FULL else 0)
    names = [k for k, _ in model.named_parameters()]
    assert list(osd["state"]) == names and osd["param_groups"][0]["params"] == names
    for fqn, p in model.named_parameters():
        avg = osd["state"][fqn]["exp_avg"]
        assert isinstance(avg, DTensor) == (kind is SHARDED) and avg.shape == p.shape, fqn
    other = wrap(build("mlp", seed=9))
    other_opt = make_opt(other.parameters())
    with FSDP.state_dict_type(other, kind, *configs):
        other.load_state_dict(msd)
        other_opt.load_state_dict(FSDP.optim_state_dict_to_load(other, other_opt, osd))
    for t in range(3, 5):
        step(model, opt, t)
        step(other, other_opt, t)
    assert_full_params_close(other, model, atol=0, rtol=0, what="optimizer state restored")


@distributed([3])
def test_summon_full_params_writeback_and_grads():
    _, rank, n = world()
    model, ref = wrap(build("mlp")), build("mlp")
    x, y = batch("mlp", 0, n * PER_RANK)
    F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
    F.cross_entropy(ref(x), y).backward()
    theirs = dict(ref.named_parameters())
    with FSDP.summon_full_params(model, with_grads=True):
        for name, p in model.named_parameters():
            assert type(p.data) is torch.Tensor and p.shape == theirs[name].shape, name
            torch.testing.assert_close(p, theirs[name], atol=0, rtol=0)
            torch.testing.assert_close(p.grad, theirs[name].grad, atol=1e-6, rtol=1e-4)
            with torch.no_grad():
                p.mul_(2)
    with FSDP.summon_full_params(model, writeback=False):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # thrown away on exit
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(p.full_tensor(), 2 * theirs[name].detach(), atol=0, rtol=0)
    with pytest.raises(ValueError, match="rank0_only=True, writeback=True"):
        with FSDP.summon_full_params(model, rank0_only=True):
            pass


@distributed([3])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
def test_clip_grad_norm_is_global(norm_type):
    _, rank, n = world()
    model, ref = wrap(build("mlp")), build("mlp")
    x, y = batch("mlp", 0, n * PER_RANK)
    F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
    F.cross_entropy(ref(x), y).backward()
    got = model.clip_grad_norm_(0.05, norm_type=norm_type)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
    assert got > 0.05  # so the gradients were clipped
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), theirs[name].grad, atol=1e-7, rtol=1e-4)
    with pytest.raises(RuntimeError, match="root"):
        model.blocks[0].clip_grad_norm_(1.0)


@distributed([2])
def test_no_sync_accumulates_then_reduces_the_sum():
    from plait.debug import CommDebugMode

    _, rank, n = world()
    model, ref = wrap(build("mlp")), build("mlp")
    batches = [batch("mlp", t, n * PER_RANK) for t in range(2)]
    with CommDebugMode() as mode:
        with model.no_sync():
            F.cross_entropy(model(mine(batches[0][0], rank)), mine(batches[0][1], rank)).backward()
    assert "reduce_scatter" not in mode.get_comm_counts()
    F.cross_entropy(model(mine(batches[1][0], rank)), mine(batches[1][1], rank)).backward()
    for x, y in batches:
        F.cross_entropy(ref(x), y).backward()
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), theirs[name].grad, atol=1e-6, rtol=1e-4)
