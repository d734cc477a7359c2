"""A save killed (SIGKILL) at any point leaves the previous checkpoint loadable and the
broken one reported as incomplete; the next save to the same path succeeds.

A forked child (torch already imported: no start-up cost; small tensors, one thread) saves version 1, then dies
during a second save, to a new path or over the same one: in the middle of writing its
tensor file, or after metadata.json is written but before the rename.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

import plait.checkpoint as dcp
from plait.checkpoint import commit, safetensors_io, storage, tools


def _state(v):
    return {"model": {"w": torch.full((60, 70), float(v)), "b": torch.full((3,), float(v))}, "step": v}


def _die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def _child(root: str, point: str, second: str) -> None:
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork; tensors are small too
    dcp.save(_state(1), checkpoint_id=os.path.join(root, "a"))
    dcp.save(_state(1), checkpoint_id=os.path.join(root, "same"))
    if point == "write":  # half a file on disk, then death
        def half(path, tensors, *, sync):
            safetensors_io.write_file(path, tensors, sync=sync)
            os.truncate(path, os.path.getsize(path) // 2)
            _die()
        storage.write_file = half
    else:  # metadata.json written in the staging dir, not yet renamed
        commit._fsync_dir = _die
    dcp.save(_state(2), checkpoint_id=os.path.join(root, second))


def _run_killed(root: str, point: str, second: str) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            _child(root, point, second)
        finally:
            os._exit(3)  # not killed: the parent's assertion below fails
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def _expect(path, value):
    state = {"model": {"w": torch.zeros(60, 70), "b": torch.zeros(3)}, "step": 0}
    dcp.load(state, checkpoint_id=path)
    assert state["step"] == value and torch.equal(state["model"]["w"], torch.full((60, 70), float(value)))


@pytest.mark.parametrize("point", ["write", "commit"])
def test_sigkill_during_save(tmp_path, point):
    root, over = str(tmp_path / "new"), str(tmp_path / "over")
    _run_killed(root, point, "b")
    _run_killed(over, point, "same")
    # a new path: the previous checkpoint loads, the killed one is reported incomplete
    _expect(os.path.join(root, "a"), 1)
    with pytest.raises(ValueError, match=r"checkpoint .*b is incomplete: a save was interrupted"):
        dcp.load({"step": 0}, checkpoint_id=os.path.join(root, "b"))
    problems = tools.verify(os.path.join(root, "b"))
    assert len(problems) == 1 and "incomplete" in problems[0]
    assert tools.main(["verify", os.path.join(root, "b")]) == 1
    # the same path: version 1 is still there, whole
    _expect(os.path.join(over, "same"), 1)
    assert tools.verify(os.path.join(over, "same")) == []
    # the next save to the killed path cleans up and commits
    dcp.save(_state(2), checkpoint_id=os.path.join(root, "b"))
    _expect(os.path.join(root, "b"), 2)
    assert not os.path.exists(os.path.join(root, "b") + commit.INCOMPLETE)
