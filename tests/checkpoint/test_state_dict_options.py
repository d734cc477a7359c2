"""StateDictOptions: flatten (torch's `state.{fqn}.{key}` / `param_groups.{fqn}.{key}`),
cpu_offload with full_state_dict (rank 0 only), ignore_frozen_params, submodules, strict and
the key errors (each names the key), _init_optim_state."""

from __future__ import annotations

import pytest
import torch

from plait.checkpoint.state_dict import (
    StateDictKeyError,
    StateDictOptions,
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from plait.tensor import DTensor
from plait.testing import distributed
from tests.checkpoint._layouts import build, lay_out, make_opt, step, world

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def trained(layout="single", seed=0):
    model = lay_out(build(seed), layout)
    opt = make_opt(model)
    step(model, opt, layout, 0)
    return model, opt


def test_flatten_keys_and_round_trip():
    model, opt = trained()
    flat = get_optimizer_state_dict(model, opt, options=FLAT)
    nested = get_optimizer_state_dict(model, opt)
    assert flat["state.mid.lin.weight.exp_avg"] is nested["state"]["mid.lin.weight"]["exp_avg"]
    assert flat["param_groups.out.bias.lr"] == 1e-2 and flat["param_groups.inp.weight.betas"] == (0.9, 0.999)
    assert all(k.startswith(("state.", "param_groups.")) for k in flat) and not any(".params" in k for k in flat)
    fresh, fresh_opt = trained(seed=3)
    set_optimizer_state_dict(fresh, fresh_opt, flat)
    for fqn, state in get_optimizer_state_dict(fresh, fresh_opt)["state"].items():
        for k, v in state.items():
            assert torch.equal(v, nested["state"][fqn][k]), (fqn, k)


def test_missing_and_unexpected_keys_name_the_key():
    model, opt = trained()
    sd = get_model_state_dict(model)
    del sd["mid.scale"]
    sd["mid.extra"] = torch.zeros(1)
    with pytest.raises(StateDictKeyError, match=r"missing key\(s\) \['mid.scale'\] and unexpected key\(s\) "
                                                 r"\['mid.extra'\]") as err:
        set_model_state_dict(model, sd)
    assert isinstance(err.value, RuntimeError) and isinstance(err.value, ValueError)
    keys = set_model_state_dict(model, sd, options=StateDictOptions(strict=False))
    assert keys.missing_keys == ["mid.scale"] and keys.unexpected_keys == ["mid.extra"]

    osd = get_optimizer_state_dict(model, opt)
    del osd["state"]["out.weight"]
    with pytest.raises(StateDictKeyError, match=r"state.out.weight"):
        set_optimizer_state_dict(model, opt, osd)
    flat = get_optimizer_state_dict(model, opt, options=FLAT)
    del flat["param_groups.inp.weight.lr"]
    with pytest.raises(StateDictKeyError, match=r"param_groups.inp.weight.lr"):
        set_optimizer_state_dict(model, opt, flat)


def test_shape_mismatch_names_key_and_both_shapes():
    model, _ = trained()
    sd = get_model_state_dict(model)
    sd["out.weight"] = torch.zeros(4, 11)
    with pytest.raises(ValueError, match=r"'out.weight': shape \(4, 11\) != the model's \(5, 11\)"):
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))


def test_bad_options_and_foreign_optimizer():
    model, opt = trained()
    with pytest.raises(ValueError, match="broadcast_from_rank0=True\\) needs full_state_dict=True"):
        get_model_state_dict(model, options=StateDictOptions(broadcast_from_rank0=True))
    other = torch.optim.SGD(build(1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[0\] holds a parameter of shape \(12, 7\) that is not"):
        get_optimizer_state_dict(model, other)


def test_frozen_params_and_submodules():
    model, opt = trained()
    model.inp.weight.requires_grad_(False)
    sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    assert "inp.weight" not in sd and "mid.lin.weight" in sd
    assert list(get_model_state_dict(model, submodules={model.mid})) == ["mid.scale", "mid.lin.weight", "mid.lin.bias"]
    short = get_model_state_dict(model, submodules={model.mid}, options=StateDictOptions(keep_submodule_prefixes=False))
    assert list(short) == ["scale", "lin.weight", "lin.bias"]


def test_init_optim_state_creates_lazy_state_without_moving_params():
    model = build(0)
    opt = make_opt(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _init_optim_state(opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    state = get_optimizer_state_dict(model, opt)["state"]
    assert set(state) == {n for n, _ in model.named_parameters()} and float(state["out.bias"]["step"]) == 1.0


@distributed(world_sizes=[2])
def test_full_cpu_offload_keeps_rank_0_only():
    model, opt = trained("fsdp")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    if world()[0] != 0:
        assert msd == {} and osd == {}
        return
    assert set(msd) == set(build(0).state_dict()) and all(type(v) is torch.Tensor for v in msd.values())
    assert all(type(s["exp_avg"]) is torch.Tensor and s["exp_avg"].device.type == "cpu" for s in osd["state"].values())
    sharded = get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
    assert isinstance(sharded["out.weight"], DTensor)  # offload alone keeps the layout


@distributed(world_sizes=[2])
def test_flatten_fsdp_state_is_dtensors_and_loads_back():
    model, opt = trained("fsdp")
    flat = get_optimizer_state_dict(model, opt, options=FLAT)
    assert isinstance(flat["state.mid.lin.weight.exp_avg"], DTensor)
    assert type(flat["state.mid.lin.weight.step"]) is torch.Tensor  # step kept as the optimizer keeps it
    fresh, fresh_opt = trained("fsdp", seed=4)
    set_optimizer_state_dict(fresh, fresh_opt, flat)
    got = get_optimizer_state_dict(fresh, fresh_opt, options=FLAT)
    for k, v in flat.items():
        if isinstance(v, DTensor):
            assert torch.equal(got[k].to_local(), v.to_local()), k
        else:
            assert (torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v), k


def test_two_optimizers_merge_and_split_like_torchs():
    from torch.distributed.checkpoint import state_dict as torch_sd

    def make(seed):
        model = build(seed)
        opts = [torch.optim.AdamW([*model.inp.parameters(), *model.mid.parameters()], lr=1e-2),
                torch.optim.SGD(model.out.parameters(), lr=0.1, momentum=0.9)]
        return model, opts

    model, opts = make(0)
    step(model, opts[0], "single", 0)
    opts[1].step()
    _, osd = get_state_dict(model, opts)
    _, theirs = torch_sd.get_state_dict(model, opts)
    assert list(osd["state"]) == list(theirs["state"]) and osd["param_groups"] == theirs["param_groups"]
    fresh, fresh_opts = make(3)
    set_optimizer_state_dict(fresh, fresh_opts, osd)
    for mine, ref in zip(fresh_opts, opts):
        assert mine.state_dict()["param_groups"] == ref.state_dict()["param_groups"]
        for pid, state in ref.state_dict()["state"].items():
            for k, v in state.items():
                assert torch.equal(mine.state_dict()["state"][pid][k], v), (pid, k)


@distributed(world_sizes=[2])
def test_bf16_fsdp_model_from_fp32_full_state():
    ref, ref_opt = trained()
    model = lay_out(build(5).to(torch.bfloat16), "fsdp")
    opt = make_opt(model)
    msd, osd = get_state_dict(ref, ref_opt)
    set_model_state_dict(model, msd, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(model, opt, osd, options=StateDictOptions(full_state_dict=True))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for k, v in full.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, msd[k].to(torch.bfloat16)), k
    state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))["state"]
    for fqn, s in state.items():  # torch's optimizer casts state to its parameter's dtype on load
        assert torch.equal(s["exp_avg"], osd["state"][fqn]["exp_avg"].to(torch.bfloat16)), fqn


@distributed(world_sizes=[2])
def test_broadcast_of_a_sharded_state_is_an_error_on_every_rank():
    """Rank 0's DTensor cannot be gathered by rank 0 alone: every rank raises, none hangs."""
    model, opt = trained("fsdp")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    sharded = get_model_state_dict(model) if world()[0] == 0 else {}
    with pytest.raises(ValueError, match=r"rank 0's 'inp.weight' is a DTensor"):
        set_model_state_dict(model, sharded, options=options)
    with pytest.raises(ValueError, match=r"rank 0 passed no state dict"):
        set_optimizer_state_dict(model, opt, {}, options=options)
    with pytest.raises(StateDictKeyError, match=r"missing key\(s\) \['inp.bias', 'inp.weight'"):
        set_model_state_dict(model, {}, options=options)


def test_stateless_optimizer_round_trips():
    """SGD without momentum keeps no state: an empty `state` is complete, not missing keys."""
    model = build(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    osd = get_optimizer_state_dict(model, opt)
    assert osd["state"] == {} and osd["param_groups"][0]["params"][0] == "inp.weight"
    set_optimizer_state_dict(model, opt, osd)
    set_optimizer_state_dict(model, opt, get_optimizer_state_dict(model, opt, options=FLAT))
