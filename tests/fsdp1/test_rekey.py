"""`FullyShardedDataParallel.rekey_optim_state_dict` and `OptimStateKeyType`: an optimizer state dict
keyed by position <-> by parameter name, equal to torch's own rekeying of the same state dict."""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import OptimStateKeyType as TorchKey

from plait.fsdp import FullyShardedDataParallel as FSDP
from plait.fsdp import OptimStateKeyType


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.Linear(3, 2, bias=False))
    model[2].requires_grad_(False)  # not every parameter has state: ids skip nothing, names skip it
    opt = torch.optim.AdamW([{"params": [model[0].weight, model[3].weight]},
                             {"params": [model[0].bias], "lr": 0.1}])
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _same(a, b):
    assert a.keys() == b.keys()
    assert list(a["state"]) == list(b["state"])
    for k in a["state"]:
        for name, v in a["state"][k].items():
            assert torch.equal(v, b["state"][k][name]), (k, name)
    assert a["param_groups"] == b["param_groups"]


@pytest.mark.filterwarnings("ignore:.*optim_input.*deprecated:FutureWarning")  # both warn, as torch
@pytest.mark.parametrize("by", ["optim", "optim_input", "model"])
def test_rekey_to_names_and_back_matches_torch(by):
    model, opt = _trained()
    osd = opt.state_dict()
    kw = {"optim": opt} if by == "optim" else {"optim_input": opt.param_groups} if by == "optim_input" else {}
    if by == "model":  # ids in model.parameters() order: the optimizer must step them all
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        osd = opt.state_dict()
    named = FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model, **kw)
    torch_named = TorchFSDP.rekey_optim_state_dict(osd, TorchKey.PARAM_NAME, model, **kw)
    _same(named, torch_named)
    assert all(isinstance(k, str) for k in named["state"])
    back = FSDP.rekey_optim_state_dict(named, OptimStateKeyType.PARAM_ID, model, **kw)
    _same(back, TorchFSDP.rekey_optim_state_dict(torch_named, TorchKey.PARAM_ID, model, **kw))
    _same(back, {**osd, "param_groups": [{**g, "params": sorted(g["params"])} for g in osd["param_groups"]]})
    assert FSDP.rekey_optim_state_dict(named, OptimStateKeyType.PARAM_NAME, model, **kw) is named


def test_rekey_names_the_problem():
    model, opt = _trained()
    osd = opt.state_dict()
    with pytest.raises(TypeError, match="PARAM_NAME or PARAM_ID"):
        FSDP.rekey_optim_state_dict(osd, "name", model, optim=opt)
    mixed = {"state": {0: {}, "0.bias": {}}, "param_groups": []}
    with pytest.raises(ValueError, match="mix names and ids"):
        FSDP.rekey_optim_state_dict(mixed, OptimStateKeyType.PARAM_NAME, model, optim=opt)
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not parameters of Linear"):
        FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, other, optim=opt)
