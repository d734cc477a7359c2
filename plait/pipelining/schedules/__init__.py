"""Pipeline schedules as data: generate, lower, check, simulate, draw.

    build_schedule / CSV / lists -> Schedule -> check -> lower (SEND/RECV) -> runtime
                                                 \\-> simulate -> render_ascii / write_svg

Everything here is pure Python: no processes, no tensors, no torch.distributed.

It is also torch's `torch.distributed.pipelining.schedules` under plait's porting rule: the
schedule classes (`ScheduleGPipe`, ..., `PipelineScheduleMulti`) and `get_schedule_class`
load from `schedule_classes.py` on first use, so importing this package stays torch-free
(`plait plan pipeline` relies on it; a test imports it in a fresh interpreter).
"""

import importlib
from typing import Any

from .actions import Action, ActionType
from .checker import CheckReport, check, matching
from .csv_io import load_csv, save_csv, schedule_from_csv, schedule_to_csv
from .dualpipev import dualpipe_v
from .generators import (
    SCHEDULES,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    looped_1f1b,
    looped_bfs,
    one_f_one_b,
    zbv_zero_bubble,
)
from .lowering import lower
from .schedule import Schedule, ScheduleError, loop_stage_to_rank, v_stage_to_rank
from .simulator import Costs, Simulation, Slot, bubble_formula, simulate
from .timeline import render_ascii, render_svg, write_png, write_svg

# torch's names: the classes live in ..schedule_classes, which needs torch.
CLASS_NAMES = (
    "PipelineScheduleMulti",
    "PipelineScheduleRuntime",
    "PipelineScheduleSingle",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLooped1F1B",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "_PipelineSchedule",
    "_PipelineScheduleRuntime",
    "get_schedule_class",
)


__all__ = [
    *(n for n in CLASS_NAMES if not n.startswith("_")),  # plait's data names, then torch's (loaded on first use)
    "SCHEDULES",
    "Action",
    "ActionType",
    "CheckReport",
    "Costs",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "Slot",
    "bubble_formula",
    "build_schedule",
    "check",
    "dualpipe_v",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zero_bubble",
    "load_csv",
    "loop_stage_to_rank",
    "looped_1f1b",
    "looped_bfs",
    "lower",
    "matching",
    "one_f_one_b",
    "render_ascii",
    "render_svg",
    "save_csv",
    "schedule_from_csv",
    "schedule_to_csv",
    "simulate",
    "v_stage_to_rank",
    "write_png",
    "write_svg",
    "zbv_zero_bubble",
]

def __getattr__(name: str) -> Any:
    if name not in CLASS_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = "schedule_base" if name == "_PipelineSchedule" else "schedule_classes"
    return getattr(importlib.import_module(f"plait.pipelining.{where}"), name)
