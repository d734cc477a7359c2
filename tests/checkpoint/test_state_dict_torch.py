"""plait.checkpoint.state_dict against torch.distributed.checkpoint.state_dict on one process:
the same keys, order, values and optimizer format (nested and flattened), tied weights
included, and each loads the other's state."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import state_dict as torch_sd

from plait.checkpoint import state_dict as plait_sd
from tests.checkpoint._layouts import build, make_opt, step


def _equal(a, b) -> None:
    kinds = (dict, list, tuple, torch.Tensor)  # torch returns model.state_dict()'s OrderedDict itself
    assert type(a) is type(b) or any(isinstance(a, k) and isinstance(b, k) for k in kinds), (type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("flat", [False, True])
def test_same_state_dict_as_torch(tied, flat):
    model = build(0, tied=tied)
    opt = make_opt(model)
    step(model, opt, "single", 0)
    ours = plait_sd.get_state_dict(model, opt, options=plait_sd.StateDictOptions(flatten_optimizer_state_dict=flat))
    theirs = torch_sd.get_state_dict(model, opt, options=torch_sd.StateDictOptions(flatten_optimizer_state_dict=flat))
    _equal(ours[0], theirs[0])
    if flat:  # torch's flat dict order follows its own traversal; the keys and values are what count
        assert sorted(ours[1]) == sorted(theirs[1])
        for k in ours[1]:
            _equal(ours[1][k], theirs[1][k])
    else:
        _equal(ours[1], theirs[1])


def test_each_loads_the_others_state():
    src = build(0)
    src_opt = make_opt(src)
    step(src, src_opt, "single", 0)
    for get, put in ((torch_sd.get_state_dict, plait_sd.set_state_dict), (plait_sd.get_state_dict, torch_sd.set_state_dict)):
        model = build(5)
        opt = make_opt(model)
        msd, osd = get(src, src_opt)
        put(model, opt, model_state_dict=msd, optim_state_dict=osd)
        _equal(plait_sd.get_state_dict(model, opt), plait_sd.get_state_dict(src, src_opt))


def _ddp_and_fsdp_like_torch() -> bool:
    """plait's DDP / fully_shard and torch's, on the same ranks: the same full state dicts."""
    from torch.distributed._composable.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from tests.checkpoint._layouts import lay_out

    full_plait = plait_sd.StateDictOptions(full_state_dict=True)
    full_torch = torch_sd.StateDictOptions(full_state_dict=True)
    for layout in ("ddp", "fsdp"):
        ours = lay_out(build(0), layout)
        if layout == "ddp":
            theirs = TorchDDP(build(0))
        else:
            mesh = torch_mesh("cpu", (torch.distributed.get_world_size(),))
            theirs = build(0)
            for child in (theirs.inp, theirs.mid, theirs.out):
                torch_fully_shard(child, mesh=mesh)
            torch_fully_shard(theirs, mesh=mesh)
        our_opt, their_opt = make_opt(ours), make_opt(theirs)
        for model, opt in ((ours, our_opt), (theirs, their_opt)):
            step(model, opt, layout, 0)  # the same slices of the same batch
        a = plait_sd.get_state_dict(ours, our_opt, options=full_plait)
        b = torch_sd.get_state_dict(theirs, their_opt, options=full_torch)
        assert list(a[0]) == list(b[0]) and list(a[1]["state"]) == list(b[1]["state"]), layout
        assert a[1]["param_groups"] == b[1]["param_groups"], layout
        for k in a[0]:  # two implementations reduce in their own order: fp32 rounding apart
            torch.testing.assert_close(a[0][k], b[0][k], rtol=1e-5, atol=1e-6, msg=k)
    return True


def test_ddp_and_fsdp_full_state_like_torchs():
    from plait.testing import run_distributed

    assert all(run_distributed(_ddp_and_fsdp_like_torch, world_size=2))
