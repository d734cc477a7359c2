"""state_dict() gives sharded DTensors under the original names; load_state_dict takes
them back (copying, or assign=True with nn.Parameter(DTensor) values as torch's FSDP2
example does); full_tensor() gives the whole parameter; clip_grad_norm_ works on the
sharded gradients and equals the single-process norm and clipping."""

import torch
import torch.nn.functional as F
from torch import nn

from plait.tensor import DTensor, Shard, distribute_tensor
from plait.testing import distributed
from tests.fsdp.common import (
    PER_RANK,
    assert_full_params_close,
    assert_grads_close,
    batch,
    build,
    make_opt,
    mine,
    shard,
    train_parity,
    world,
)


def _train(model, steps, rank, n):
    opt = make_opt(model.parameters())
    for step in range(steps):
        x, y = batch("mlp", step, n * PER_RANK)
        F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
        opt.step()
        opt.zero_grad()


@distributed([1, 2, 3])
def test_state_dict_is_sharded_under_original_names():
    _, rank, n = world()
    model, ref = shard(build("mlp"), reshard_after_forward=False), build("mlp")
    model.unshard()  # state_dict reshards first: it never returns the unsharded parameters
    assert not isinstance(model.inp.weight, DTensor)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    for name, value in sd.items():
        if name == "scale":  # a buffer: not sharded
            assert not isinstance(value, DTensor)
            torch.testing.assert_close(value, ref_sd[name])
            continue
        assert isinstance(value, DTensor) and value.placements == (Shard(0),), name
        torch.testing.assert_close(value.full_tensor(), ref_sd[name], atol=0, rtol=0)


@distributed([2, 3])
def test_load_state_dict_round_trip():
    _, rank, n = world()
    trained = shard(build("mlp"))
    _train(trained, 3, rank, n)
    sd = trained.state_dict()
    copied = shard(build("mlp", seed=1))
    copied.load_state_dict(sd)
    assert all(isinstance(p, DTensor) for p in copied.parameters())
    assert_full_params_close(copied, trained, atol=0, rtol=0, what="after load_state_dict")
    # the copy trains on exactly like the original
    ref = build("mlp")
    ref.load_state_dict({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()})
    train_parity("mlp", copied, ref, steps=3)


@distributed([2, 3])
def test_load_state_dict_assign_with_parameters_from_a_full_state_dict():
    """torch's FSDP2 example: a full state dict distributed like the meta model's params."""
    _, rank, n = world()
    full_sd = build("mlp", seed=5).state_dict()
    with torch.device("meta"):
        model = build("mlp")
    shard(model)
    meta_sd = model.state_dict()
    sharded_sd = {}
    for name, full in full_sd.items():
        meta = meta_sd[name]
        if isinstance(meta, DTensor):
            sharded_sd[name] = nn.Parameter(distribute_tensor(full, meta.device_mesh, meta.placements))
        else:
            sharded_sd[name] = full
    model.load_state_dict(sharded_sd, strict=False, assign=True)
    for name, p in model.named_parameters():
        assert p is sharded_sd[name] and not p.is_meta, name
    ref = build("mlp", seed=5)
    assert_full_params_close(model, ref, atol=0, rtol=0, what="after assign")
    train_parity("mlp", model, ref, steps=3)  # FSDP gathers and steps the assigned parameters
    assert_full_params_close(model, ref, atol=2e-5, rtol=1e-4, what="after training")


@distributed([1, 2, 3])
def test_clip_grad_norm_on_sharded_gradients():
    _, rank, n = world()
    model, ref = shard(build("mlp")), build("mlp")
    x, y = batch("mlp", 0, n * PER_RANK)
    F.cross_entropy(model(mine(x, rank)), mine(y, rank)).backward()
    F.cross_entropy(ref(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.1)
    assert ref_norm > 0.1  # clipping happens
    value = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.testing.assert_close(value, ref_norm, rtol=1e-5, atol=1e-7)
    assert_grads_close(model, ref, atol=1e-7, rtol=1e-5, what="clipped")
