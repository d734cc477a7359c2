"""The driver's shortcuts for the built-in global hooks (driver.py) change no byte and no result.

    the same state saved by the built-ins (shortcut) and by a planner whose create_global_plan
    is an override calling the built-in (the full reduce_scatter step): identical files,
    byte for byte, metadata.json included; collectives counted on each rank
    loaded by the built-ins and by the same override on the load side: the same tensors,
    fewer collectives (the identity hooks: 5 -> 2)
    a failure on one rank still reaches every rank on both shortcut paths
"""

from __future__ import annotations

import os

import pytest
import torch

import plait.checkpoint as dcp
from plait.comm import events
from plait.testing import run_distributed
from tests.checkpoint._states import full, laid_out, reference


class FullSavePlanner(dcp.DefaultSavePlanner):
    def create_global_plan(self, all_plans):  # an override: the driver takes torch's full step
        return super().create_global_plan(all_plans)


class FullLoadPlanner(dcp.DefaultLoadPlanner):
    def create_global_plan(self, global_plan):
        return super().create_global_plan(global_plan)


class _Count(events.CommListener):
    wants_end = False

    def __init__(self) -> None:
        self.ops: list[str] = []

    def on_start(self, event) -> None:
        self.ops.append(event.op)


def _counted(fn) -> list[str]:
    c = _Count()
    events.add_listener(c)
    try:
        fn()
    finally:
        events.remove_listener(c)
    return c.ops


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


def _save_both(root: str, world_size: int) -> dict:
    state = {"model": laid_out("S0xS1" if world_size == 4 else "S0", world_size), "step": 7, "note": {"a": [1, 2]}}
    short = _counted(lambda: dcp.save(state, checkpoint_id=os.path.join(root, "short")))
    whole = _counted(lambda: dcp.save(state, checkpoint_id=os.path.join(root, "full"), planner=FullSavePlanner()))
    loads = {}
    for name, planner in (("short", None), ("full", FullLoadPlanner())):
        back = {"model": laid_out("S1", world_size, zero=True), "step": 0, "note": None}
        ops = _counted(lambda b=back, n=name, p=planner: dcp.load(b, checkpoint_id=os.path.join(root, n), planner=p))
        loads[name] = (ops, {k: full(v) for k, v in back["model"].items()}, back["step"], back["note"])
    return {"save": (short, whole), "load": loads}


@pytest.mark.parametrize("world_size", [2, 4])
def test_shortcuts_write_the_same_bytes_and_load_the_same_values(tmp_path, world_size):
    got = run_distributed(_save_both, str(tmp_path), world_size, world_size=world_size)
    assert _files(str(tmp_path / "short")) == _files(str(tmp_path / "full"))  # metadata.json too
    for rank_got in got:
        short, whole = rank_got["save"]
        # full: plans gathered and scattered (4), results gathered (2), the Metadata scattered (2)
        assert len(whole) == 8 and len(short) == 7, (whole, short)
        loads = rank_got["load"]
        # full: plans gathered and scattered (4), the read errors' flag (1); short: the two flags
        assert len(loads["full"][0]) == 5 and loads["short"][0] == ["all_reduce", "all_reduce"], loads
        for _ops, tensors, step, note in loads.values():
            assert step == 7 and note == {"a": [1, 2]}
            assert all(torch.equal(tensors[k].view(torch.uint8), v.view(torch.uint8)) for k, v in reference().items())


def _failing(root: str, what: str) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    state = {"w": torch.arange(6.0)}
    dcp.save(state, checkpoint_id=root)
    # rank 1's state dict lacks a key the checkpoint has... and has one it lacks
    back = {"w": torch.zeros(6)} if rank == 0 else {"w": torch.zeros(6), "absent": torch.zeros(2)}
    if what == "save":
        back = {"w": torch.arange(6.0)} if rank == 0 else {"w": torch.arange(6.0), "bad": object()}
    try:
        (dcp.save if what == "save" else dcp.load)(back, checkpoint_id=root)
    except Exception as e:  # noqa: BLE001 - the type and message are the result
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("what", ["save", "load"])
def test_a_failing_rank_still_stops_every_rank(tmp_path, what):
    got = run_distributed(_failing, str(tmp_path / "c"), what, world_size=2)
    assert got[1].startswith(("ValueError", "TypeError")) and ("absent" in got[1] or "bad" in got[1]), got
    assert got[0].startswith("CheckpointError") and "rank 1" in got[0], got
