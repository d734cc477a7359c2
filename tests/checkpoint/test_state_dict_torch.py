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
