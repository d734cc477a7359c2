"""torch's schedule classes, each a thin shell: build the schedule as data, hand it to the runtime.

    ScheduleX(stage(s), n_microbatches, loss_fn) -> build_schedule("X", ranks, m) -> Schedule
        -> PipelineRuntime (lower + check, once) ;  step(x, target=y, losses=l):
    split batch -> runtime.run -> losses (last stage's rank) -> grads / m -> merged output

Every class, built-in or custom (`PipelineScheduleRuntime` with action lists or a CSV), runs
on the same runtime; they differ only in the `Schedule` they pass it. The rank's stages must
be the ones the schedule places on it (stage s on rank s % p, V style for ZBV and DualPipeV), else an
error says which stages were expected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from .microbatch import merge_chunks, split_args_kwargs_into_chunks, split_tensor
from .runtime import PipelineRuntime
from .schedules import Action, Schedule, build_schedule, load_csv, looped_1f1b
from .stage import PipelineStage


class _PipelineSchedule:
    """What every schedule shares: microbatching, the loss, grad scaling, `step` and `eval`."""

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: tuple | None = None,
        kwargs_chunk_spec: dict | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
    ) -> None:
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        if not stages:
            raise ValueError("a schedule needs at least one stage on this rank")
        self._stages = list(stages)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self._backward_requires_autograd = backward_requires_autograd
        self._has_backward = loss_fn is not None
        self.group = stages[0].group
        self.rank = stages[0].group_rank
        self.pp_group_size = stages[0].group_size
        self._num_stages = stages[0].num_stages
        for s in stages:
            if s.group is not self.group or s.num_stages != self._num_stages:
                raise ValueError(
                    f"stages {stages[0].stage_index} and {s.stage_index} disagree on the group "
                    f"or num_stages ({self._num_stages} vs {s.num_stages})"
                )
        self._runtime: PipelineRuntime | None = None

    # --- the schedule as data --------------------------------------------------------------

    def _use(self, schedule: Schedule) -> None:
        """Adopt `schedule` (covering all ranks): check placement, lower and check it."""
        if schedule.num_ranks != self.pp_group_size:
            raise ValueError(
                f"the schedule has {schedule.num_ranks} ranks, the group {self.pp_group_size}"
            )
        if schedule.num_stages != self._num_stages:
            raise ValueError(
                f"the schedule has {schedule.num_stages} stages but the stages say num_stages="
                f"{self._num_stages}"
            )
        if schedule.num_microbatches != self._n_microbatches:
            raise ValueError(
                f"the schedule runs {schedule.num_microbatches} microbatches, but n_microbatches="
                f"{self._n_microbatches}"
            )
        expected = list(schedule.stages_of(self.rank))
        given = sorted(s.stage_index for s in self._stages)
        if given != expected:
            raise ValueError(
                f"rank {self.rank} was given stages {given}, but {schedule.name} places stages "
                f"{expected} on it (stage -> rank: {list(schedule.stage_to_rank)})"
            )
        for s in self._stages:
            s.stage_index_to_group_rank = schedule.stage_to_rank
        self.schedule = schedule
        self._runtime = PipelineRuntime(self._stages, schedule, self.group)
        self._runtime.plan(self._has_backward)  # check before the first step

    @property
    def pipeline_order(self) -> dict[int, list[Action]]:
        """Per rank, the compute actions (torch's attribute, without idle placeholders)."""
        return {r: list(a) for r, a in enumerate(self.schedule.compute_only().actions)}

    @property
    def pipeline_order_with_comms(self) -> dict[int, list[Action]]:
        """Per rank, the lowered actions the runtime executes."""
        lowered = self._runtime.plan(self._has_backward)
        return {r: list(a) for r, a in enumerate(lowered.actions)}

    @property
    def timeline(self) -> list[tuple[Action, float, float]]:
        """This rank's compute actions in the last step with (start, end) perf_counter times."""
        return self._runtime.timeline if self._runtime else []

    # --- running ---------------------------------------------------------------------------

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list | None = None,
        return_outputs: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Run one iteration on the whole batch: split into microbatches, run the schedule,
        append each microbatch's loss to `losses` (on the rank of the last stage), scale the
        grads by 1/n_microbatches (if `scale_grads`) and return the merged last-stage output."""
        if self._runtime is None:
            raise RuntimeError(f"{type(self).__name__} has no schedule loaded yet")
        if self._has_backward and self._backward_requires_autograd and not torch.is_grad_enabled():
            raise RuntimeError("step() runs backward: call it with grad enabled, or use eval()")
        return self._step(args, kwargs, target, losses, return_outputs, self._has_backward)

    def eval(
        self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any
    ) -> Any:
        """Forward only: outputs (and losses, if target is given) without any backward."""
        if self._runtime is None:
            raise RuntimeError(f"{type(self).__name__} has no schedule loaded yet")
        return self._step(args, kwargs, target, losses, True, False)

    def _step(self, args, kwargs, target, losses, return_outputs, has_backward) -> Any:
        m = self._n_microbatches
        local = {s.stage_index: s for s in self._stages}
        if 0 in local and not args and not kwargs:
            raise ValueError(f"rank {self.rank} runs stage 0: pass the batch to step()")
        last = local.get(self._num_stages - 1)
        if last is not None and has_backward and target is None:
            raise ValueError(
                f"rank {self.rank} runs the last stage, which computes loss_fn(output, target) "
                "per microbatch: pass target= to step()"
            )
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list, got {type(losses).__name__}")
        if args or kwargs:
            arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(
                args, kwargs, m, self._args_chunk_spec, self._kwargs_chunk_spec
            )
        else:
            arg_mbs, kwarg_mbs = [()] * m, [{}] * m
        target_mbs = split_tensor(target, m) if target is not None and last is not None else None
        got = self._runtime.run(arg_mbs, kwarg_mbs, target_mbs, self._loss_fn, has_backward)
        if has_backward and self.scale_grads:
            seen: set[int] = set()
            for stage in self._stages:  # a param shared by two local stages is scaled once
                for p in stage.submod.parameters():
                    if p.grad is not None and id(p) not in seen:
                        seen.add(id(p))
                        p.grad.div_(m)
        if last is not None and losses is not None and got:
            losses.extend(got[mb] for mb in range(m))
        if last is not None and return_outputs:
            return merge_chunks(
                [last.output_chunks[mb] for mb in range(m)], self._output_merge_spec
            )
        return None


class PipelineScheduleSingle(_PipelineSchedule):
    """One stage per rank; subclasses name the generator (torch's base class)."""

    _name = ""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Callable | None = None,
        args_chunk_spec: tuple | None = None,
        kwargs_chunk_spec: dict | None = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
    ) -> None:
        super().__init__(
            [stage],
            n_microbatches,
            loss_fn,
            args_chunk_spec,
            kwargs_chunk_spec,
            output_merge_spec,
            scale_grads,
        )
        self._stage = stage
        if stage.num_stages != self.pp_group_size:
            raise ValueError(
                f"{type(self).__name__} runs one stage per rank: num_stages({stage.num_stages}) "
                f"!= group size({self.pp_group_size}); use a multi-stage schedule"
            )
        self._use(build_schedule(self._name, self.pp_group_size, n_microbatches))


class PipelineScheduleMulti(_PipelineSchedule):
    """Several stages per rank (the same number on every rank); torch's base class."""

    _name = ""

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
        if self._name:
            p, n = self.pp_group_size, self._num_stages
            if n % p:
                raise ValueError(
                    f"{type(self).__name__}: num_stages({n}) is not a multiple of "
                    f"the group size({p})"
                )
            self._use(self._build(p, n_microbatches, n // p))

    def _build(self, num_ranks: int, n_microbatches: int, stages_per_rank: int) -> Schedule:
        """The schedule as data for the whole group (a subclass with options overrides it)."""
        return build_schedule(
            self._name, num_ranks, n_microbatches, stages_per_rank=stages_per_rank
        )


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
