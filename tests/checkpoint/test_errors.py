"""A damaged checkpoint or a state dict that does not fit it is an error naming the file,
the key and both values; never silently wrong tensors. One process, no process group.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import plait.checkpoint as dcp
from plait.checkpoint import tools


def _state():
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g).bfloat16()},
            "step": 5}


def _empty():
    return {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.bfloat16)}, "step": 0}


@pytest.fixture
def saved(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save(_state(), checkpoint_id=path)
    return path


def _chunk(path, fqn):
    return dcp.FileSystemReader(path).read_metadata().tensors[fqn].chunks[0]


def test_intact_checkpoint_loads_and_verifies(saved):
    state = _empty()
    dcp.load(state, checkpoint_id=saved)
    ref = _state()
    assert torch.equal(state["model"]["w"], ref["model"]["w"]) and torch.equal(state["model"]["b"], ref["model"]["b"])
    assert state["step"] == 5 and tools.verify(saved) == []
    assert tools.main(["verify", saved]) == 0


def test_flipped_byte_names_file_and_tensor(saved):
    c = _chunk(saved, "model.w")
    with open(os.path.join(saved, c.file), "r+b") as f:
        f.seek(c.begin + 17)
        b = f.read(1)
        f.seek(c.begin + 17)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(dcp.ChunkError, match=rf"checksum mismatch in file '{c.file}' for tensor 'model.w'"):
        dcp.load(_empty(), checkpoint_id=saved)
    problems = tools.verify(saved)
    assert len(problems) == 1 and "model.w" in problems[0]
    assert tools.main(["verify", saved]) == 1


def test_truncated_file(saved):
    c = _chunk(saved, "model.w")
    name = os.path.join(saved, c.file)
    os.truncate(name, os.path.getsize(name) - 3)
    with pytest.raises(dcp.ChunkError, match=rf"file '{c.file}' is truncated: .* tensor 'model\.(w|b)'"):
        dcp.load(_empty(), checkpoint_id=saved)
    assert tools.main(["verify", saved]) == 1


def test_missing_file(saved):
    c = _chunk(saved, "model.w")
    os.remove(os.path.join(saved, c.file))
    with pytest.raises(dcp.ChunkError, match=rf"file '{c.file}' of tensor 'model\.(w|b)' is missing"):
        dcp.load(_empty(), checkpoint_id=saved)


def test_wrong_shape_and_dtype_name_key_and_both_values(saved):
    state = _empty()
    state["model"]["w"] = torch.zeros(6, 5)
    with pytest.raises(ValueError, match=r"state_dict\['model.w'\] is float32\[6, 5\] but .* saved float32\[6, 4\]"):
        dcp.load(state, checkpoint_id=saved)
    state = _empty()
    state["model"]["b"] = torch.zeros(4)
    with pytest.raises(ValueError, match=r"'model.b'\] is float32\[4\] but .* saved bfloat16\[4\]"):
        dcp.load(state, checkpoint_id=saved)


def test_missing_and_unexpected_keys(saved):
    state = _empty()
    state["model"]["extra"] = torch.zeros(2)
    with pytest.raises(ValueError, match="missing key 'model.extra'"):
        dcp.load(state, checkpoint_id=saved)
    state = _empty()
    del state["model"]["b"]  # a different model: the checkpoint's model has a key this one lacks
    with pytest.raises(ValueError, match="unexpected key 'model.b'"):
        dcp.load(state, checkpoint_id=saved)
    # loading a part of the checkpoint (the model, not the step) is fine, as in torch
    part = {"model": _empty()["model"]}
    dcp.load(part, checkpoint_id=saved)
    assert torch.equal(part["model"]["w"], _state()["model"]["w"])


def test_allow_partial_load_skips_absent_keys_only(saved):
    """As torch's DefaultLoadPlanner: a key the checkpoint lacks is skipped (reported); a key it
    has in another shape or dtype is an error all the same, naming both and the checkpoint
    (skipping it would train on with that tensor's fresh init)."""
    state = _empty()
    state["model"]["extra"] = torch.zeros(2)
    planner = dcp.DefaultLoadPlanner(allow_partial_load=True)
    with pytest.warns(UserWarning):
        dcp.load(state, checkpoint_id=saved, planner=planner)
    assert any("missing key 'model.extra'" in r for r in planner.report)
    assert torch.equal(state["model"]["w"], _state()["model"]["w"]) and state["step"] == 5
    for key, wrong, said in [("b", torch.zeros(3, dtype=torch.bfloat16), r"bfloat16\[3\] but checkpoint .* saved bfloat16\[4\]"),
                             ("w", torch.zeros(6, 4, dtype=torch.float64), r"float64\[6, 4\] but checkpoint .* saved float32\[6, 4\]"),
                             ("b", 7, r"a int but checkpoint .* saved a tensor bfloat16\[4\]")]:
        state = _empty()
        state["model"][key] = wrong
        with pytest.raises(ValueError, match=rf"state_dict\['model.{key}'\] is .*{said}") as e:
            dcp.load(state, checkpoint_id=saved, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
        assert saved in str(e.value)
    state = _empty()
    state["step"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"state_dict\['step'\] is a tensor but checkpoint .* saved a non-tensor value 5"):
        dcp.load(state, checkpoint_id=saved, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))


def test_values_round_trip_exactly_and_objects_are_refused(tmp_path):
    values = {"t": (1, (2.5, None), "s", True), "i": 3, "f": 3.0, "nan": math.nan, "inf": -math.inf,
              "d": {0: "a", "k": [1, 2]}, "by": b"\x00\xff", "dt": torch.bfloat16, "empty": {}}
    path = str(tmp_path / "v")
    dcp.save({"v": values}, checkpoint_id=path)
    got = {"v": {k: None for k in values}}
    got["v"]["empty"] = {}
    dcp.load(got, checkpoint_id=path)
    for k, v in values.items():
        assert type(got["v"][k]) is type(v), k
        assert got["v"][k] == v or (k == "nan" and math.isnan(got["v"][k])), k
    assert type(got["v"]["t"][1]) is tuple and type(got["v"]["i"]) is int and type(got["v"]["f"]) is float
    with pytest.raises(TypeError, match=r"state_dict\['v.o'\] holds a builtins.object"):
        dcp.save({"v": {"o": object()}}, checkpoint_id=str(tmp_path / "o"))
    assert not os.path.exists(tmp_path / "o")


def test_tied_and_noncontiguous_tensors(tmp_path):
    w = torch.randn(4, 6)
    state = {"a": w, "tied": w, "t": w.t(), "step": torch.tensor(3.0), "none": torch.zeros(0, 3)}
    path = str(tmp_path / "c")
    dcp.save(state, checkpoint_id=path)
    out = {"a": torch.zeros(4, 6), "tied": torch.zeros(4, 6), "t": torch.zeros(6, 4), "step": torch.tensor(0.0),
           "none": torch.zeros(0, 3)}
    dcp.load(out, checkpoint_id=path)
    assert torch.equal(out["a"], w) and torch.equal(out["tied"], w) and torch.equal(out["t"], w.t())
    assert out["step"].item() == 3.0


def test_no_checkpoint_and_overwrite_false(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint at"):
        dcp.load(_empty(), checkpoint_id=str(tmp_path / "nothing"))
    path = str(tmp_path / "c")
    dcp.save(_state(), checkpoint_id=path)
    with pytest.raises(ValueError, match="already exists and the writer has overwrite=False"):
        dcp.save(_state(), storage_writer=dcp.FileSystemWriter(path, overwrite=False))
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(path, thread_count=2))  # overwrite=True (default)
    assert tools.verify(path) == []
