"""A custom schedule, given as torch's CSV or as action lists, runs on the same runtime.

Both CSVs mix full backwards (B) with split ones (I then W); the second places stages in a V
that no built-in generator makes with this order. Each is checked when loaded and then must
train like one process (the parity test's model, float64, 1e-9).
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest

from plait import comm
from plait.pipelining import (
    PipelineScheduleRuntime,
    PipelineStage,
    ScheduleError,
    _PipelineScheduleRuntime,
    load_csv,
    lower,
    save_csv,
)
from plait.pipelining.schedules import schedule_from_csv
from plait.testing import distributed

from .test_runtime_parity import _model, _reference, _stage_modules, train_and_compare

TWO_STAGES = """\
0F0,0F1,0F2,0I0,0F3,0B1,0W0,0I2,0B3,0W2
1F0,1I0,1F1,1B1,1F2,1W0,1I2,1F3,1B3,1W2
"""
V_MIXED = """\
0F0,0F1,0F2,3F0,3I0,3W0,3F1,3B1,0F3,0I0,0W0,3F2,3I2,3W2,0B1,3F3,3I3,3W3,0I2,0W2,0I3,0W3
1F0,2F0,1F1,2F1,2I0,2W0,1F2,1I0,1W0,2F2,2B1,1F3,1B1,2F3,2I2,2W2,1I2,2I3,1I3,1W2,2W3,1W3
"""
CSVS = {"two stages": (TWO_STAGES, 2), "V, B mixed with I/W": (V_MIXED, 4)}


def _setup(num_stages: int, owned: list[int]):
    model, loss_fn, tol = _model("uneven")
    reference = _reference(copy.deepcopy(model), loss_fn, "uneven", tol["eps"])
    modules = _stage_modules(model, "uneven", num_stages, owned)
    stages = [PipelineStage(m, s, num_stages, "cpu") for m, s in zip(modules, owned)]
    return modules, stages, loss_fn, tol, reference


@distributed([2])
@pytest.mark.parametrize("csv_name", list(CSVS))
@pytest.mark.parametrize("format", ["compute_only", "compute_comms"])
def test_custom_csv_schedule_trains_like_one_process(csv_name, format):
    text, num_stages = CSVS[csv_name]
    rank = comm.get_rank(comm.world_group())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "schedule.csv")
        with open(path, "w") as f:
            f.write(text)
        if format == "compute_comms":  # the lowered form, as torch's _dump_csv writes it
            save_csv(lower(load_csv(path)), path)
        owned = list(load_csv(path).stages_of(rank))
        modules, stages, loss_fn, tol, reference = _setup(num_stages, owned)
        schedule = _PipelineScheduleRuntime(stages, n_microbatches=4, loss_fn=loss_fn)
        schedule._load_csv(path, format=format)
    assert schedule.schedule.stage_to_rank == ((0, 1) if num_stages == 2 else (0, 1, 1, 0))
    train_and_compare(schedule, modules, owned, num_stages, "uneven", tol, reference)
    ran = [a for a, _, _ in schedule.timeline]
    assert ran == [a for a in schedule_from_csv(text).actions[rank] if a.is_compute]


@distributed([2])
def test_action_lists_run_like_the_csv():
    rows = {r: line.split(",") for r, line in enumerate(TWO_STAGES.splitlines())}
    rank = comm.get_rank(comm.world_group())
    modules, stages, loss_fn, tol, reference = _setup(2, [rank])
    schedule = PipelineScheduleRuntime(stages, n_microbatches=4, loss_fn=loss_fn)
    schedule.load_actions(rows)
    train_and_compare(schedule, modules, [rank], 2, "uneven", tol, reference)


@distributed([2])
def test_a_bad_custom_schedule_is_rejected_before_it_runs():
    rank = comm.get_rank(comm.world_group())
    _, stages, loss_fn, _, _ = _setup(2, [rank])
    schedule = PipelineScheduleRuntime(stages, n_microbatches=4, loss_fn=loss_fn)
    missing_w = {
        0: TWO_STAGES.splitlines()[0].split(","),
        1: [a for a in TWO_STAGES.splitlines()[1].split(",") if a != "1W2"],
    }
    with pytest.raises(
        ScheduleError, match=r"rank 1.*missing 1W2: 1I2 \(action #6\) is never followed"
    ):
        schedule.load_actions(missing_w)
    rows = [line.split(",") for line in TWO_STAGES.splitlines()]
    with pytest.raises(
        ValueError,
        match=rf"rank {rank} was given stages \[{rank}\], but custom "
        rf"places stages \[{1 - rank}\] on it",
    ):
        schedule.load_actions({0: rows[1], 1: rows[0]})  # the rows swapped: stages on wrong ranks
