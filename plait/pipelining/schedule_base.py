"""What every schedule class shares, torch's base classes: microbatching, the loss, grad
scaling, `step` and `eval`, on the one runtime.

    step(x, target=y, losses=l): split batch into chunks -> runtime.run(the schedule as data)
        -> losses (last stage's rank) -> grads / m -> merged output

`PipelineScheduleSingle` holds one stage per rank, `PipelineScheduleMulti` several; a subclass
names its generator (`_name`) or builds its `Schedule` itself (schedule_classes.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .microbatch import merge_chunks, split_args_kwargs_into_chunks, split_tensor
from .runtime import PipelineRuntime
from .schedules import Action, Schedule, build_schedule
from .stage import PipelineStage


class _PipelineSchedule:
    """What every schedule shares: microbatching, the loss, grad scaling, `step` and `eval`."""

    _computes_per_step = 1  # computes one step of the schedule runs (the runtime's early receives)

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
        self._runtime = PipelineRuntime(self._stages, schedule, self.group,
                                        computes_per_step=self._computes_per_step)
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
