"""Save in one layout, load into another: every element lands where it was, bitwise.

Layouts: one process (plain tensors), Shard(0)/Shard(1)/Replicate on world 2, 3, 4, and
2-D meshes mixing Shard and Replicate (Shard on both axes of one dim included), FSDP over
TP's (_StridedShard(d, sf=2), Shard(d)) on 2 x 2; every
tensor has dims that the world size does not divide, and one has fewer rows than ranks.
"""

from __future__ import annotations

import os

import pytest
import torch

import plait.checkpoint as dcp
from plait.checkpoint import tools
from plait.testing import run_distributed
from tests.checkpoint._states import full, laid_out, reference


def save_layout(path: str, layout: str | None, world_size: int) -> list[str]:
    state = {"model": laid_out(layout, world_size), "step": 3, "extra": (1, 2.5, None, "x")}
    dcp.save(state, checkpoint_id=path)
    return sorted(os.listdir(path))


def load_layout(path: str, layout: str | None, world_size: int) -> bool:
    state = {"model": laid_out(layout, world_size, zero=True), "step": 0, "extra": None}
    dcp.load(state, checkpoint_id=path)
    ref = reference()
    for k, v in state["model"].items():
        got = full(v)
        assert got.dtype == ref[k].dtype and torch.equal(got.view(torch.uint8) if got.dtype != torch.int64 else got,
                                                         ref[k].view(torch.uint8) if got.dtype != torch.int64 else ref[k]), k
    assert state["step"] == 3 and state["extra"] == (1, 2.5, None, "x") and type(state["step"]) is int
    return True


def _run(fn, path, layout, world):
    return [fn(path, layout, 1)] if world == 1 else run_distributed(fn, path, layout, world, world_size=world)


CASES = [  # (save layout, save world, load layout, load world)
    (None, 1, "S0", 3),
    ("S0", 4, "S1", 2),
    ("S0xS1", 4, "S0", 3),
    ("S0", 3, "RxS0", 4),
    ("RxS0", 4, None, 1),
    ("S0xS0", 4, "S0xS1", 4),
    ("R", 2, "S0xS0", 4),
    ("SSxS0", 4, "S1", 3),  # FSDP over TP's strided layout, saved and loaded into others
    ("S0xS0", 4, "SSxS0", 4),
    ("SSxS0", 4, None, 1),
    ("SS1xS1", 4, "SSxS0", 4),
]


@pytest.mark.parametrize("save_as,save_world,load_as,load_world", CASES)
def test_round_trip_between_layouts(tmp_path, save_as, save_world, load_as, load_world):
    path = str(tmp_path / "ckpt")
    files = _run(save_layout, path, save_as, save_world)[0]
    assert "metadata.json" in files and not os.path.exists(path + ".incomplete")
    assert all(_run(load_layout, path, load_as, load_world))


def test_replicated_chunks_are_written_once(tmp_path):
    """Dedup: a Replicate axis does not multiply the bytes on disk."""
    path = str(tmp_path / "ckpt")
    run_distributed(save_layout, path, "RxS0", 4, world_size=4)
    meta = dcp.FileSystemReader(path).read_metadata()
    for k, v in reference().items():
        t = meta.tensors["model." + k]
        assert sum(c.nbytes for c in t.chunks) == v.numel() * v.element_size(), k
        assert t.layout["placements"][0] == "Replicate()"
    # consolidated: one safetensors file of full tensors, that safetensors itself opens
    from safetensors.torch import load_file

    out = str(tmp_path / "full.safetensors")
    assert tools.main(["consolidate", path, out]) == 0
    got = load_file(out)
    assert got.keys() == {"model." + k for k in reference()}
    for k, v in reference().items():
        assert torch.equal(got["model." + k].view(torch.uint8), v.view(torch.uint8)), k
    # and a rank file opens with safetensors too
    from safetensors import safe_open

    with safe_open(os.path.join(path, "__0_0.safetensors"), "pt") as f:
        assert all(k.startswith("model.") for k in f.keys())


def save_partial(path: str) -> str:
    from plait.device_mesh import init_device_mesh
    from plait.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (2,))
    x = DTensor.from_local(torch.ones(3, 2), mesh, [Partial()])
    try:
        dcp.save({"x": x}, checkpoint_id=path)
    except ValueError as e:
        return str(e)
    return "saved"


def test_partial_is_refused_before_anything_is_written(tmp_path):
    path = str(tmp_path / "p")
    for msg in run_distributed(save_partial, path, world_size=2):
        assert "state_dict['x'] is a DTensor with placements [Partial(sum)]" in msg and "redistribute" in msg, msg
    assert not os.path.exists(path) and not os.path.exists(path + ".incomplete")
