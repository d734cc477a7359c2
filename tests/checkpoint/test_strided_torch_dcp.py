"""A torch DCP checkpoint of torch's FSDP x TP (its colwise weights and biases saved as
(_StridedShard(0, sf=2), Shard(0)) DTensors) converts with `plait checkpoint
import-torch-dcp` and loads into plait's FSDP x TP on 4 ranks and into one plain process,
bitwise equal to what torch saved; plait's own FSDP x TP checkpoint loads into one process
bitwise too.
"""

from __future__ import annotations

import torch

import plait.checkpoint as dcp
from plait.checkpoint import tools
from plait.testing import run_distributed
from tests.checkpoint._layouts import build, lay_out


def torch_save(path: str) -> dict:
    import torch.distributed.checkpoint as torch_dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build(seed=3)
    parallelize_module(model, mesh["tp"], {"inp": ColwiseParallel(), "mid.lin": RowwiseParallel()})
    fully_shard(model.mid, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    sd = model.state_dict()
    assert repr(tuple(sd["inp.bias"].placements)) == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    torch_dcp.save({"model": sd}, checkpoint_id=path)
    return {k: v.full_tensor() for k, v in sd.items() if hasattr(v, "full_tensor")}


def plait_load(path: str) -> dict:
    model = lay_out(build(seed=5), "fsdp_tp")
    sd = model.state_dict()
    assert repr(sd["inp.bias"].placements) == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    dcp.load({"model": sd}, checkpoint_id=path)
    model.load_state_dict(sd)
    return {k: p.full_tensor() for k, p in model.named_parameters()}


def plait_save(path: str) -> dict:
    model = lay_out(build(seed=3), "fsdp_tp")
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    return {k: p.full_tensor() for k, p in model.named_parameters()}


def _single(path: str) -> dict:
    model = build(seed=9)
    sd = dict(model.state_dict())
    dcp.load({"model": sd}, checkpoint_id=path)
    return {k: v for k, v in sd.items() if k in dict(model.named_parameters())}


def _assert_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_torch_fsdp_tp_checkpoint_loads_into_plait_fsdp_tp_and_one_process(tmp_path):
    src, out = str(tmp_path / "torch"), str(tmp_path / "plait")
    want = run_distributed(torch_save, src, world_size=4)[0]
    assert tools.main(["import-torch-dcp", src, out]) == 0
    for got in run_distributed(plait_load, out, world_size=4):
        _assert_equal(got, want)
    _assert_equal(_single(out), want)


def test_plait_fsdp_tp_checkpoint_loads_into_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    want = run_distributed(plait_save, path, world_size=4)[0]
    _assert_equal(_single(path), want)
