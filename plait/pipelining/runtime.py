"""The one runtime: run this rank's list of a lowered schedule, with plait.comm p2p.

    Schedule (any: built-in, lists, CSV) --lower--> per-rank actions --check--> plan (cached)
        --compile (program.py, once)--> this rank's program
    step: [first step only: F of microbatch 0 down the stages, carrying shape metadata]
          for each op of the program, in order (on Gloo each RECV is posted one compute early):
              run of SEND/RECV -> one comm.batch_isend_irecv; receives kept in their slots
              F | B | I | W    -> wait for the receive it reads, then compute on the stage
          wait for every send
    data-parallel stages (DDP / replicate / fully_shard submodule): sync off at the start
          (FSDP: unsharded once); after a stage's m-th B|W one async all-reduce (FSDP: one
          reduce-scatter per group) of its grads; waited here, before scale_grads

This relies on the lowering contract (`schedules/lowering.py`): sends come right after their
producer, receives before their consumer, in the same order on both ends of each rank pair.
Ops are posted without blocking and waited on only where consumed (receives) or at the end
(sends; completed ones are reaped on the way), the relaxations the contract allows, so any
schedule that passes `check` runs without deadlock.

Shapes (first step of a runtime only): each rank, for its stages in ascending order, gets
the input metadata (from the previous stage's rank, or its own stage before it), runs F on
microbatch 0 for real and passes on metadata plus activation. Those F, SEND_F and RECV_F of
microbatch 0 are then skipped in the list: removing matched pairs keeps the per-pair order,
and F(s, 0) reads only F(s-1, 0), which every rank has done before it, stage by stage.

Stages s and s+1 on the same rank (ZBV's turn-around) hand over activations and grads in
memory; the lowering puts no SEND/RECV between them.

On an accelerator sends and receives run on their own stream (`p2p`; None on CPU, where
none of this runs): p2p.wait_stream(compute) then the batch posted on p2p (the sends read
what compute wrote, the receive buffers were allocated there); a compute that reads a
receive waits for it on p2p, then compute.wait(event recorded on p2p); at the end the sends
are waited on p2p and compute.wait(event), before their activations can be reused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import ProcessGroup

from plait import comm
from plait.comm import device as streams_api

from .meta import recv_metas, send_metas
from .program import Compute, Post, Program, compile_program
from .schedules import Action, ActionType, Schedule, check, lower
from .stage import PipelineStage

_F, _B, _I, _W = ActionType.F, ActionType.B, ActionType.I, ActionType.W
_SEND_F, _RECV_F, _SEND_B, _RECV_B = (
    ActionType.SEND_F,
    ActionType.RECV_F,
    ActionType.SEND_B,
    ActionType.RECV_B,
)
_FORWARD_KINDS = frozenset({_F, _SEND_F, _RECV_F})
EARLY_RECVS = 1  # on Gloo, each receive is posted this many of the schedule's steps before its place


def forward_only(schedule: Schedule) -> Schedule:
    """The lowered schedule without backward: F and its transfers (eval, no loss_fn).

    Cut from a checked lowered schedule, it needs no check of its own (the checker would
    reject it for its missing backwards): it drops only whole SEND/RECV pairs, so the
    per-pair message order holds, and the global order witnessing that the full schedule
    cannot deadlock, restricted to what is left, witnesses it for this one."""
    return Schedule(
        tuple(tuple(a for a in acts if a.kind in _FORWARD_KINDS) for acts in schedule.actions),
        schedule.stage_to_rank,
        schedule.num_microbatches,
        f"{schedule.name} (forward only)",
    )


@dataclass
class _Step:
    """One step's inputs and in-flight state on this rank."""

    arg_mbs: list[tuple]
    kwarg_mbs: list[dict]
    target_mbs: list[Any] | None
    loss_fn: Callable | None
    recvs: list[list[comm.Handle] | None]  # by slot (program.py)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    sends: list[comm.Handle] = field(default_factory=list)
    skip: set[Action] = field(default_factory=set)
    weight_grads: dict[int, int] = field(default_factory=dict)  # stage -> B|W done this step


class PipelineRuntime:
    """Executes `schedule` (compute-only or lowered, covering every stage) for `stages`,
    the stages this rank owns. One instance per schedule object."""

    def __init__(self, stages: Sequence[PipelineStage], schedule: Schedule, group: ProcessGroup, *,
                 computes_per_step: int = 1):
        self.stages = {s.stage_index: s for s in stages}
        self.schedule = schedule
        self.group = group
        self.rank = comm.get_rank(group)
        self.timeline: list[tuple[Action, float, float]] = []  # last step: compute, perf_counter
        self._plans: dict[bool, Schedule] = {}
        self._programs: dict[bool, Program] = {}
        self._shapes_known = False
        # Gloo matches each direction of a pair on its own: receives can be posted a step of
        # the schedule early (program.py says why, and why not on NCCL): `computes_per_step`
        # computes, 2 where a step is an overlapped forward and backward (DualPipeV: with 1,
        # half a step early, its host row read 1.00-1.03x torch's wall; with 2, 0.96-0.99x);
        # read when a program is compiled
        gloo = comm.group_info(group).backend == "gloo"
        self.early_recvs = EARLY_RECVS * computes_per_step if gloo else 0
        self.device = next(iter(self.stages.values())).device  # every stage of a rank is on one device
        self.p2p = streams_api.side_stream(self.device, "pipelining.p2p")  # None on CPU

    def plan(self, has_backward: bool) -> Schedule:
        """The lowered, checked schedule for a step with or without backward (cached)."""
        if True not in self._plans:
            lowered = self.schedule if self.schedule.is_lowered else lower(self.schedule)
            check(lowered)  # a ScheduleError names the first bad action and its rank
            self._plans[True] = lowered
        if not has_backward and False not in self._plans:
            self._plans[False] = forward_only(self._plans[True])
        return self._plans[has_backward]

    def program(self, has_backward: bool) -> Program:
        """This rank's part of `plan(has_backward)`, compiled once (program.py)."""
        found = self._programs.get(has_backward)
        if found is None:
            actions = self.plan(has_backward).actions[self.rank]
            found = self._programs[has_backward] = compile_program(
                actions, self.stages, early_recvs=self.early_recvs
            )
        return found

    def run(
        self,
        arg_mbs: list[tuple],
        kwarg_mbs: list[dict],
        target_mbs: list | None,
        loss_fn: Callable | None,
        has_backward: bool,
    ) -> dict[int, torch.Tensor]:
        """One step; returns this rank's losses by microbatch (detached; empty if none)."""
        program = self.program(has_backward)
        for stage in self.stages.values():
            stage.clear_runtime_states()
            stage.has_backward = has_backward
        step = _Step(arg_mbs, kwarg_mbs, target_mbs, loss_fn, [None] * program.num_slots)
        self.timeline = []
        syncing = [s for s in self.stages.values() if has_backward and s.grad_sync is not None]
        for stage in syncing:
            stage.grad_sync.begin_step()
        if not self._shapes_known:
            self._infer_shapes(step, program)
            self._shapes_known = True
        skip = step.skip
        compute, post = self._compute, self._post
        for op in program.ops:
            if op.__class__ is Compute:
                if not skip or op.action not in skip:
                    compute(op, step)
            else:
                post(op, step)
        if self.p2p is None:
            for handle in step.sends:
                handle.wait()
        elif step.sends:
            self._wait_on_p2p(step.sends)
        for stage in syncing:
            stage.grad_sync.end_step()  # grads averaged over data parallel; then scale_grads
        assert not any(step.recvs), f"rank {self.rank}: receives never consumed"
        for stage in self.stages.values():
            stage.assert_drained()
        return {mb: loss.detach() for mb, loss in step.losses.items()}

    def _infer_shapes(self, step: _Step, program: Program) -> None:
        for s in sorted(self.stages):
            stage = self.stages[s]
            if s > 0 and s - 1 not in self.stages:
                src = stage.rank_of(s - 1)
                metas = recv_metas(src=src, group=self.group)
                stage.set_inputs_meta(metas)
                bufs = [comm.recv(m.empty(stage.device), src=src, group=self.group) for m in metas]
                stage.set_local_input(0, tuple(bufs))
                step.skip.add(Action(s, _RECV_F, 0))
            elif s > 0:
                stage.set_inputs_meta(self.stages[s - 1].outputs_meta)
            self._compute(program.computes[Action(s, _F, 0)], step)
            step.skip.add(Action(s, _F, 0))
            if not stage.is_last and s + 1 not in self.stages:
                dst = stage.rank_of(s + 1)
                step.sends += send_metas(stage.outputs_meta, dst=dst, group=self.group)
                step.sends += [
                    comm.isend(t, dst=dst, group=self.group) for t in stage.take_outputs(0)
                ]
                step.skip.add(Action(s, _SEND_F, 0))

    def _post(self, post: Post, step: _Step) -> None:
        """Post a run of consecutive SEND/RECV as one batch_isend_irecv."""
        ops: list[comm.P2POp] = []
        owners: list[tuple[int, int]] = []  # (slot, ops) per transfer
        skip = step.skip
        for t in post.transfers:
            if skip and t.action in skip:
                continue
            new = t.make(t.microbatch)
            owners.append((t.slot, len(new)))
            ops += new
        if not ops:
            return
        if self.p2p is None:
            handles = comm.batch_isend_irecv(ops)
        else:
            streams_api.wait_stream(self.p2p, streams_api.current_stream(self.device))
            with streams_api.stream_context(self.p2p):
                handles = comm.batch_isend_irecv(ops)
        if len(owners) == 1 and owners[0][0] >= 0:  # the common case: one receive
            step.recvs[owners[0][0]] = handles
            return
        k = 0
        for slot, n in owners:
            if slot >= 0:
                step.recvs[slot] = handles[k : k + n]
            else:
                step.sends += handles[k : k + n]
            k += n
        step.sends = _reap(step.sends)

    def _compute(self, op: Compute, step: _Step) -> None:
        stage, kind, mb = op.stage, op.kind, op.microbatch
        start = time.perf_counter()
        if op.wait >= 0:
            handles = step.recvs[op.wait]
            if handles is not None:
                step.recvs[op.wait] = None
                if self.p2p is None:
                    for handle in handles:
                        handle.wait()
                else:
                    self._wait_on_p2p(handles)
        if kind is _F:
            args = step.arg_mbs[mb] if stage.is_first else ()
            output = stage.forward_one_chunk(mb, args, step.kwarg_mbs[mb])
            if stage.is_last and step.loss_fn is not None and step.target_mbs is not None:
                with torch.set_grad_enabled(stage.has_backward):
                    step.losses[mb] = step.loss_fn(output, step.target_mbs[mb])
            elif op.hand_to is not None:
                op.hand_to.set_local_input(mb, stage.take_outputs(mb))
        elif kind is _B or kind is _I:
            loss = None
            if stage.is_last:
                loss = step.losses[mb]
                step.losses[mb] = loss.detach()  # the graph must not outlive I (see backward.py)
            stage.backward_one_chunk(mb, loss=loss, full_backward=kind is _B)
            if op.hand_to is not None:
                op.hand_to.set_local_grads(mb, stage.take_input_grads(mb))
        elif kind is _W:
            stage.backward_weight_one_chunk(mb)
        if op.weight_grads:  # each microbatch's weight grads come from its B or W
            s = stage.stage_index
            done = step.weight_grads[s] = step.weight_grads.get(s, 0) + 1
            if stage.grad_sync is not None:
                stage.grad_sync.after_backward()
                if done == self.schedule.num_microbatches:
                    stage.grad_sync.last_backward()  # one reduction per step, launched now
        self.timeline.append((op.action, start, time.perf_counter()))

    def _wait_on_p2p(self, handles: list[comm.Handle]) -> None:
        """The p2p stream waits for `handles` (not the host, on NCCL); compute waits for that."""
        with streams_api.stream_context(self.p2p):
            for handle in handles:
                handle.wait()
            done = streams_api.record_event(self.p2p)
        streams_api.wait_event(streams_api.current_stream(self.device), done)


def _reap(sends: list[comm.Handle]) -> list[comm.Handle]:
    """Finish the sends that completed (dropping the activations they kept alive); keep the rest."""
    pending = []
    for handle in sends:
        if handle.is_completed():
            handle.wait()
        else:
            pending.append(handle)
    return pending
