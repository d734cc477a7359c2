"""`plait checkpoint import-torch-dcp`: a checkpoint written by torch.distributed.checkpoint
converts and loads equal to what torch saved; a .metadata crafted to run code on
unpickling is refused before it can.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.device_mesh import init_device_mesh as torch_mesh
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import distribute_tensor as torch_distribute

import plait.checkpoint as dcp
from plait.checkpoint import tools
from plait.testing import run_distributed


def _reference():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(7, 3, generator=g), "e": torch.randn(5, 2, generator=g).bfloat16(),
            "n": {"i": torch.arange(6)}, "step": 11}


def torch_save_sharded(path: str) -> None:
    mesh = torch_mesh("cpu", (2,))
    ref = _reference()
    state = {"w": torch_distribute(ref["w"], mesh, [TorchShard(0)]), "e": torch_distribute(ref["e"], mesh, [TorchShard(1)]),
             "n": ref["n"], "step": ref["step"]}
    torch_dcp.save(state, checkpoint_id=path)


def test_torch_dcp_checkpoint_converts_and_equals(tmp_path):
    src, out = str(tmp_path / "dcp"), str(tmp_path / "plait")
    run_distributed(torch_save_sharded, src, world_size=2)
    assert tools.main(["import-torch-dcp", src, out]) == 0
    assert tools.verify(out) == []
    ref = _reference()
    got = {"w": torch.zeros(7, 3), "e": torch.zeros(5, 2, dtype=torch.bfloat16), "n": {"i": torch.zeros(6, dtype=torch.int64)},
           "step": 0}
    dcp.load(got, checkpoint_id=out)
    assert torch.equal(got["w"], ref["w"]) and torch.equal(got["e"], ref["e"]) and torch.equal(got["n"]["i"], ref["n"]["i"])
    assert got["step"] == 11
    assert len(dcp.FileSystemReader(out).read_metadata().tensors["w"].chunks) == 2  # torch's two shards


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("payload", ["os.system", "builtins.eval"])
def test_crafted_metadata_is_refused(tmp_path, payload):
    src, marker = tmp_path / "evil", tmp_path / "ran"
    src.mkdir()
    evil = _RunsCode(str(marker)) if payload == "os.system" else type(
        "E", (), {"__reduce__": lambda self: (eval, (f"open({str(marker)!r}, 'w')",))})()
    (src / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": evil}))
    with pytest.raises(pickle.UnpicklingError, match=r"refusing (posix|os)\.system|refusing builtins\.eval"):
        from plait.checkpoint.dcp_import import import_torch_dcp
        import_torch_dcp(str(src), str(tmp_path / "out"))
    assert tools.main(["import-torch-dcp", str(src), str(tmp_path / "out2")]) == 1
    assert not marker.exists()
