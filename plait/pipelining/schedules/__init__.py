"""Pipeline schedules as data: generate, lower, check, simulate, draw.

    build_schedule / CSV / lists -> Schedule -> check -> lower (SEND/RECV) -> runtime
                                                 \\-> simulate -> render_ascii / write_svg

Everything here is pure Python: no processes, no tensors, no torch.distributed.
"""

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
    looped_bfs,
    one_f_one_b,
    zbv_zero_bubble,
)
from .lowering import lower
from .schedule import Schedule, ScheduleError, loop_stage_to_rank, v_stage_to_rank
from .simulator import Costs, Simulation, Slot, bubble_formula, simulate
from .timeline import render_ascii, render_svg, write_png, write_svg

__all__ = [
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
