"""async_save writes what sync save writes, returns once the state is staged (the write
may still be running), and the next save waits for the previous one.

No timing is asserted: the background write is held on an Event, so "returned before the
write" and "the next save waited" are facts, not durations.
"""

from __future__ import annotations

import threading

import torch

import plait.checkpoint as dcp
from plait.checkpoint import storage
from plait.testing import run_distributed
from tests.checkpoint._states import full, laid_out, reference


def _chunks(path):
    md = dcp.FileSystemReader(path).read_metadata()
    return {k: sorted((c.offsets, c.sizes, c.crc32) for c in t.chunks) for k, t in md.tensors.items()}, md.values


def test_async_equals_sync_and_stages_before_returning(tmp_path, monkeypatch):
    state = {"w": torch.randn(33, 7), "b": torch.randn(5).bfloat16(), "step": 4}
    ref = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    dcp.save(state, checkpoint_id=str(tmp_path / "sync"))
    gate, real = threading.Event(), storage.write_file
    entered = threading.Event()

    def held(*args, **kwargs):
        entered.set()
        assert gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(storage, "write_file", held)
    fut = dcp.async_save(state, checkpoint_id=str(tmp_path / "async"))
    assert entered.wait(60) and not fut.done()  # returned while the write is held
    state["w"].add_(1.0)  # the next training step changes the tensors: the save has its own copy
    second_done = threading.Event()

    def second():
        dcp.async_save(state, checkpoint_id=str(tmp_path / "async2")).result()
        second_done.set()

    t = threading.Thread(target=second)
    t.start()
    t.join(0.2)
    assert not second_done.is_set()  # cannot have finished: it waits for the first save
    gate.set()
    md = fut.result(60)
    t.join(60)
    assert second_done.is_set() and set(md.tensors) == {"w", "b"}
    assert _chunks(str(tmp_path / "async")) == _chunks(str(tmp_path / "sync"))
    out = {"w": torch.zeros(33, 7), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0}
    dcp.load(out, checkpoint_id=str(tmp_path / "async"))
    assert torch.equal(out["w"], ref["w"]) and torch.equal(out["b"], ref["b"]) and out["step"] == 4


def async_save_layout(path: str, world_size: int) -> bool:
    fut = dcp.async_save({"model": laid_out("S0xS1", world_size), "step": 3}, checkpoint_id=path)
    fut.result(60)
    return True


def sync_load_layout(path: str, world_size: int) -> bool:
    state = {"model": laid_out("S0", world_size, zero=True), "step": 0}
    dcp.load(state, checkpoint_id=path)
    ref = reference()
    return all(torch.equal(full(v).view(torch.uint8), ref[k].view(torch.uint8)) for k, v in state["model"].items())


def test_async_save_on_4_ranks_loads_on_3(tmp_path):
    path = str(tmp_path / "ckpt")
    # rank 0's future resolves at the commit; the others' once their files are written, so the
    # load starts after the run (every rank's result) has returned
    assert all(run_distributed(async_save_layout, path, 4, world_size=4))
    assert all(run_distributed(sync_load_layout, path, 3, world_size=3))
