"""torch's schedule classes, each a thin shell: build the schedule as data, hand it to the runtime.

    ScheduleX(stage(s), n_microbatches, loss_fn) -> build_schedule("X", ranks, m) -> Schedule
        -> PipelineRuntime (lower + check, once) ;  step(x, target=y, losses=l):
    split batch -> runtime.run -> losses (last stage's rank) -> grads / m -> merged output

Every class, built-in or custom (`PipelineScheduleRuntime` with action lists or a CSV), runs
on the same runtime (schedule_base.py: what they share); they differ only in the `Schedule`
they pass it. The rank's stages must be the ones the schedule places on it (stage s on rank
s % p, V style for ZBV and DualPipeV), else an error says which stages were expected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from .schedule_base import PipelineScheduleMulti, PipelineScheduleSingle
from .schedules import Action, Schedule, load_csv, looped_1f1b
from .stage import PipelineStage


class ScheduleGPipe(PipelineScheduleSingle):
    """All forwards, then all backwards."""

    _name = "GPipe"


class Schedule1F1B(PipelineScheduleSingle):
    """One forward one backward in steady state; rank r holds p - r microbatches."""

    _name = "1F1B"


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Breadth first over each rank's stages (torch's arguments: no chunk specs)."""

    _name = "LoopedBFS"

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
    ) -> None:
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
        )


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """1F1B interleaved over v stages per rank (stage s on rank s % p)."""

    _name = "Interleaved1F1B"


class ScheduleLooped1F1B(PipelineScheduleMulti):
    """Looped 1F1B (plait's; torch has no such class): looped placement, 1F1B steady state,
    microbatches through each local stage in rounds of `microbatches_per_round` (default p).

    With the default it is Lamy-Poirier's looped depth-first schedule, i.e. Megatron's
    interleaved 1F1B: the same action lists as ScheduleInterleaved1F1B whenever
    n_microbatches is a multiple of the group size p (which it requires; Interleaved1F1B
    also takes torch's flexible rounds). `microbatches_per_round=n_microbatches` takes every
    microbatch through a local stage before the next (breadth-first, like
    ScheduleLoopedBFS) but keeps the 1F1B steady state, where LoopedBFS runs all forwards
    then all backwards. See `schedules.generators.looped_1f1b` for the bubble and memory.
    """

    _name = "Looped1F1B"

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable | None = None,
        args_chunk_spec: tuple | None = None,
        kwargs_chunk_spec: dict | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        *,
        microbatches_per_round: int | None = None,
    ) -> None:
        self.microbatches_per_round = microbatches_per_round
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
            backward_requires_autograd,
        )

    def _build(self, num_ranks: int, n_microbatches: int, stages_per_rank: int) -> Schedule:
        return looped_1f1b(
            num_ranks,
            n_microbatches,
            stages_per_rank=stages_per_rank,
            microbatches_per_round=self.microbatches_per_round,
        )


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """ZB-H1, interleaved: backward split into I and W, W filling the bubble."""

    _name = "InterleavedZeroBubble"


class ScheduleZBVZeroBubble(PipelineScheduleMulti):
    """Zero bubble V: two stages per rank, rank r owning stages r and 2p-1-r."""

    _name = "ZBVZeroBubble"

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable | None = None,
        args_chunk_spec: tuple | None = None,
        kwargs_chunk_spec: dict | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
    ) -> None:
        if len(stages) != 2:
            raise ValueError(
                f"ScheduleZBVZeroBubble needs exactly 2 stages per rank, got {len(stages)}"
            )
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
            backward_requires_autograd,
        )


class ScheduleDualPipeV(PipelineScheduleMulti):
    """DualPipeV: two stages per rank (V placement), forward of one microbatch paired with the
    backward of another, split backward in warm-up and cool-down. Needs m >= 2p.

    `pipeline_order` lists each of torch's OVERLAP_F_B pairs as its two actions, F then B
    (torch's runtime runs them in that order too; see `schedules/dualpipev.py`).
    `defer_pp_recv`: torch's option to post receives late; plait posts them early and waits
    only at the consumer, and has no deferred mode, so True is refused."""

    _name = "DualPipeV"
    _computes_per_step = 2  # a forward and a backward, torch's one OVERLAP_F_B action

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable | None = None,
        args_chunk_spec: tuple | None = None,
        kwargs_chunk_spec: dict | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
    ) -> None:
        if len(stages) != 2:
            raise ValueError(
                f"ScheduleDualPipeV needs exactly 2 stages per rank, got {len(stages)}"
            )
        if defer_pp_recv:
            raise ValueError(
                "ScheduleDualPipeV(defer_pp_recv=True) is not supported: plait posts each "
                "receive early and waits for it only at the action that reads it"
            )
        num_stages = stages[0].num_stages
        if n_microbatches < num_stages:
            raise ValueError(
                f"DualPipeV needs at least as many microbatches as stages: n_microbatches("
                f"{n_microbatches}) < num_stages({num_stages})"
            )
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
            backward_requires_autograd,
        )


class PipelineScheduleRuntime(PipelineScheduleMulti):
    """A custom schedule: per-rank action lists or torch's CSV, run by the same runtime.

        sched = PipelineScheduleRuntime(stages, n_microbatches=4, loss_fn=loss_fn)
        sched.load_csv("my.csv")                      # or load_actions({0: ["0F0", ...], ...})
        sched.step(x, target=y)

    The stage placement is read off the actions; it is checked (`schedules.check`) before
    the first step, and a compute-only schedule is lowered first. torch's spellings
    `_PipelineScheduleRuntime`, `_load_actions` and `_load_csv` work too.
    """

    def load_actions(
        self,
        actions: dict[int, Sequence] | Sequence[Sequence] | Schedule,
        format: Literal["compute_only", "compute_comms"] = "compute_only",
    ) -> None:
        if isinstance(actions, Schedule):
            schedule = actions
        else:
            rows = [actions[r] for r in sorted(actions)] if isinstance(actions, dict) else actions
            schedule = Schedule.from_lists(
                [
                    [a if a is None or isinstance(a, Action) else str(a) for a in row]
                    for row in rows
                ],
                num_microbatches=self._n_microbatches,
            )
        self._use(_as_format(schedule, format))

    def load_csv(
        self,
        filename: str | Path,
        format: Literal["compute_only", "compute_comms"] = "compute_only",
    ) -> None:
        self._use(_as_format(load_csv(filename, num_microbatches=self._n_microbatches), format))

    _load_actions = load_actions
    _load_csv = load_csv


def _as_format(schedule: Schedule, format: str) -> Schedule:
    if format == "compute_only":
        if schedule.is_lowered:
            raise ValueError(
                "format='compute_only' but the schedule has SEND/RECV actions; "
                "pass format='compute_comms'"
            )
        return schedule
    if format == "compute_comms":
        return schedule
    raise ValueError(f"format must be 'compute_only' or 'compute_comms', got {format!r}")


_PipelineScheduleRuntime = PipelineScheduleRuntime


_BY_NAME: dict[str, type] = {  # torch's keys (and order), then plait's own schedule
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "GPipe": ScheduleGPipe,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "PipelineScheduleSingle": PipelineScheduleSingle,
    "PipelineScheduleMulti": PipelineScheduleMulti,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "DualPipeV": ScheduleDualPipeV,
    "Looped1F1B": ScheduleLooped1F1B,
}


def get_schedule_class(schedule_name: str) -> type:
    """The schedule class named `schedule_name`, case-insensitively (torch's function):
    "1F1B", "GPipe", "Interleaved1F1B", ..., or a class name such as "ScheduleGPipe"."""
    if not isinstance(schedule_name, str):
        raise TypeError(f"schedule_name must be a str, got {type(schedule_name).__name__}")
    lookup = {k.lower(): cls for k, cls in _BY_NAME.items()}
    lookup.update({cls.__name__.lower(): cls for cls in _BY_NAME.values()})
    cls = lookup.get(schedule_name.lower())
    if cls is None:
        raise ValueError(
            f"Unknown schedule name '{schedule_name}'. The valid options are {list(_BY_NAME)} "
            "(any case; the class names, e.g. 'ScheduleGPipe', work too)"
        )
    return cls
