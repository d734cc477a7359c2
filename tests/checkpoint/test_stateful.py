"""Stateful members (torch DCP tutorial's AppState(model, optimizer)) save and load through
their own state_dict/load_state_dict, and FSDP state saved on 2 ranks resumes on 3.

The model's and the Adam optimizer's state (step counts included) are compared bitwise
with what was saved: a checkpoint copies bytes, so nothing is allowed to differ.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import _init_optim_state

import plait.checkpoint as dcp
from plait.device_mesh import init_device_mesh
from plait.fsdp import fully_shard
from plait.tensor import DTensor
from plait.testing import run_distributed


class AppState:
    """As in torch's DCP tutorial (there with get_state_dict; the protocol is the point)."""

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state_dict):
        self.model.load_state_dict(state_dict["model"])
        self.optimizer.load_state_dict(state_dict["optim"])


def _model(world_size: int | None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))  # 7 rows: uneven on 2 and 3
    if world_size is not None:
        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _full(sd):
    out = {}
    for k, v in sd["model"].items():
        out["model." + k] = v.full_tensor() if isinstance(v, DTensor) else v
    for pid, st in sd["optim"]["state"].items():
        for k, v in st.items():
            out[f"optim.{pid}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v
    return out


def train_and_save(path: str, world_size: int | None):
    model, opt = _model(world_size)
    for i in range(2):
        model(torch.full((4, 5), float(i + 1))).sum().backward()
        opt.step()
        opt.zero_grad()
    app = AppState(model, opt)
    dcp.save({"app": app, "epoch": 2}, checkpoint_id=path)
    return {k: v.clone() for k, v in _full(app.state_dict()).items()}


def load_and_report(path: str, world_size: int | None):
    model, opt = _model(world_size)
    _init_optim_state(opt)
    state = {"app": AppState(model, opt), "epoch": 0}
    dcp.load(state, checkpoint_id=path)
    return _full(state["app"].state_dict()), state["epoch"], opt.param_groups[0]["lr"]


def test_app_state_fsdp_world_2_to_world_3_and_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(train_and_save, path, 2, world_size=2)[0]
    assert any(k.endswith(".step") for k in saved)
    for got, epoch, lr in [*run_distributed(load_and_report, path, 3, world_size=3), load_and_report(path, None)]:
        assert epoch == 2 and lr == 0.1 and got.keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(got[k], v), k
