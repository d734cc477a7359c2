"""Pipeline parallelism: a model split into stages on ranks, microbatches streamed through.

A schedule is data (`schedules`): per rank, a list of actions `(stage, F|B|I|W, microbatch)`
that pure functions generate, a lowering pass completes with SEND/RECV, and a checker and
simulator vet before anything runs. One runtime executes them:

    model --pipeline() / split_model()--> stage modules --PipelineStage / build_stage--> stages
          (pipeline() cuts at split_spec and at pipe_split() calls in forward)
    ScheduleX(stages, n_microbatches, loss_fn) --build_schedule, lower, check--> runtime
    schedule.step(x, target=y, losses=l): microbatches through F/B/I/W with plait.comm p2p
"""

import importlib
from typing import Any

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

# The runtime needs torch; the schedules do not. Runtime names load on first use, so
# `plait plan pipeline` (which imports this package) still starts without torch.
_RUNTIME = {
    "PipelineStage": "stage",
    "build_stage": "stage",
    "Pipe": "split",
    "PipeInfo": "split",
    "pipe_split": "trace",
    "SplitPoint": "split",
    "TraceError": "trace",
    "StageModule": "split",
    "pipeline": "split",
    "split_evenly": "split",
    "split_model": "split",
    "units": "split",
    "TensorChunkSpec": "microbatch",
    "merge_chunks": "microbatch",
    "split_args_kwargs_into_chunks": "microbatch",
    **dict.fromkeys(
        [
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
            "_PipelineScheduleRuntime",
        ],
        "schedule_classes",
    ),
}


def __getattr__(name: str) -> Any:
    module = _RUNTIME.get(name)
    if module is None:
        raise AttributeError(f"module 'plait.pipelining' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = [
    "Action",
    "ActionType",
    "CheckReport",
    "Costs",
    "Pipe",
    "PipeInfo",
    "PipelineScheduleMulti",
    "PipelineScheduleRuntime",
    "PipelineScheduleSingle",
    "PipelineStage",
    "Schedule",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLooped1F1B",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "ScheduleError",
    "Simulation",
    "SplitPoint",
    "StageModule",
    "TensorChunkSpec",
    "TraceError",
    "_PipelineScheduleRuntime",
    "build_schedule",
    "build_stage",
    "check",
    "load_csv",
    "lower",
    "merge_chunks",
    "pipe_split",
    "pipeline",
    "render_ascii",
    "render_svg",
    "save_csv",
    "simulate",
    "split_args_kwargs_into_chunks",
    "split_evenly",
    "split_model",
    "units",
    "write_svg",
]
