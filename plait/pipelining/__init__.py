"""Pipeline parallelism: a model split into stages on ranks, microbatches streamed through.

A schedule is data (`schedules`): per rank, a list of actions `(stage, F|B|I|W, microbatch)`
that pure functions generate, a lowering pass completes with SEND/RECV, and a checker and
simulator vet before anything runs. The runtime that executes them (PipelineStage and
torch's Schedule* classes) builds on these lists.
"""

from .schedules import (
    Action,
    ActionType,
    CheckReport,
    Costs,
    Schedule,
    ScheduleError,
    Simulation,
    build_schedule,
    check,
    load_csv,
    lower,
    render_ascii,
    render_svg,
    save_csv,
    simulate,
    write_svg,
)

__all__ = [
    "Action",
    "ActionType",
    "CheckReport",
    "Costs",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "build_schedule",
    "check",
    "load_csv",
    "lower",
    "render_ascii",
    "render_svg",
    "save_csv",
    "simulate",
    "write_svg",
]
