"""Receives posted a compute early (Gloo): same order, same numbers, nothing left in flight.

program.py moves every RECV of a rank's program one compute sooner. What must hold: each
peer's receives keep their order (so the n-th send still meets the n-th receive), sends do
not move, every receive is posted before its consumer, nothing moves ahead of the first
compute; and a run with early receives computes exactly what a run without them computes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
    build_schedule,
)
from plait.pipelining.program import Compute, Post, compile_program
from plait.pipelining.schedules import lower
from plait.testing import distributed

from .test_runtime_comm_events import _FakeStage

SCHEDULES = [  # name, stages per rank (None: one)
    ("GPipe", None),
    ("1F1B", None),
    ("Interleaved1F1B", 2),
    ("LoopedBFS", 2),
    ("InterleavedZeroBubble", 2),
    ("ZBVZeroBubble", 2),
    ("DualPipeV", 2),
]


def _posts(program):
    """[(compute ordinal it is posted before, action, slot)] for every transfer, in order."""
    out, n = [], 0
    for op in program.ops:
        if isinstance(op, Compute):
            n += 1
        else:
            out += [(n, t.action, t.slot) for t in op.transfers]
    return out


@pytest.mark.parametrize("name,v", SCHEDULES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_early_receives_keep_each_peers_order_and_come_before_their_consumer(name, v, p):
    lowered = lower(build_schedule(name, p, 2 * p, stages_per_rank=v))
    moved = 0
    for rank in range(p):
        stages = {s: _FakeStage(s) for s in lowered.stages_of(rank)}
        late = compile_program(lowered.actions[rank], stages)
        early = compile_program(lowered.actions[rank], stages, early_recvs=1)
        computes = [op.action for op in late.ops if isinstance(op, Compute)]
        assert [op.action for op in early.ops if isinstance(op, Compute)] == computes
        before, after = _posts(late), _posts(early)
        # sends: the same ones, in the same order, before the same computes
        assert [x for x in after if x[2] < 0] == [x for x in before if x[2] < 0]
        # receives: the same order (so per peer too), each one compute sooner but never
        # ahead of the first compute
        recv_late = [x for x in before if x[2] >= 0]
        recv_early = [x for x in after if x[2] >= 0]
        assert [x[1:] for x in recv_early] == [x[1:] for x in recv_late]
        for (n_late, action, _), (n_early, _, _) in zip(recv_late, recv_early):
            assert n_early == max(n_late - 1, min(n_late, 1)), (name, rank, action)
            moved += n_early != n_late
        # each receive's slot is read by a compute that comes after its post
        reads = {op.wait: i for i, op in enumerate(early.ops) if isinstance(op, Compute)}
        for i, op in enumerate(early.ops):
            if isinstance(op, Post):
                for t in op.transfers:
                    if t.slot >= 0:
                        assert reads[t.slot] > i, (name, rank, t.action)
    assert moved, f"{name} on {p} ranks: no receive moved (the test would prove nothing)"


def _rank():
    g = comm.world_group()
    return comm.get_rank(g), comm.get_world_size(g)


def _build(name: str, rank: int, seed: int = 0):
    """(schedule, owned stages) over fresh modules from one seed, 2 ranks."""
    torch.manual_seed(seed)
    if name == "1F1B":
        owned = [rank]
        num_stages = 2
    elif name == "Interleaved1F1B":
        owned = [rank, rank + 2]
        num_stages = 4
    else:
        owned = [rank, 3 - rank]
        num_stages = 4
    modules = {s: nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for s in range(num_stages)}
    stages = [PipelineStage(copy.deepcopy(modules[s]), s, num_stages, "cpu") for s in owned]
    cls = {"1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
           "ZBVZeroBubble": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}[name]
    schedule = cls(stages[0] if len(stages) == 1 else stages, 4, loss_fn=F.mse_loss)
    return schedule, owned, num_stages


def _step(schedule, owned, num_stages, x, y):
    """One step from zero grads; (losses, grads by stage) of this rank."""
    for s in schedule._stages:
        for p in s.submod.parameters():
            p.grad = None
    losses = []
    schedule.step(
        *((x,) if 0 in owned else ()),
        target=y if num_stages - 1 in owned else None,
        losses=losses,
    )
    grads = [p.grad.clone() for s in schedule._stages for p in s.submod.parameters()]
    return losses, grads


@distributed([2])
@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_early_receives_compute_what_late_receives_compute_bit_for_bit(name):
    """The default on Gloo: a receive posted one step of the schedule early; a step of DualPipeV
    is a forward and a backward (torch's OVERLAP_F_B), so two computes there."""
    rank, _ = _rank()
    torch.manual_seed(1)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    results = {}
    default = 2 if name == "DualPipeV" else 1
    for early in (0, default):
        schedule, owned, num_stages = _build(name, rank)
        assert schedule._runtime.early_recvs == default
        schedule._runtime.early_recvs = early  # read when the program is compiled
        results[early] = [_step(schedule, owned, num_stages, x, y) for _ in range(2)]
        posts = _posts(schedule._runtime.program(True))
        assert any(slot >= 0 for _, _, slot in posts)
    for (l0, g0), (l1, g1) in zip(results[0], results[default]):
        assert len(l0) == len(l1) and all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert len(g0) == len(g1) and all(torch.equal(a, b) for a, b in zip(g0, g1))


class _Ops(comm.CommListener):
    def __init__(self):
        self.ops: list[str] = []

    def on_start(self, event):
        self.ops.append(event.op)


@distributed([2])
@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_a_refused_batch_posts_nothing_and_the_next_step_is_unharmed(name):
    rank, _ = _rank()
    schedule, owned, num_stages = _build(name, rank)
    torch.manual_seed(2)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    first = _step(schedule, owned, num_stages, x, y)
    if rank == 0:  # stage 0 refuses the batch at its first compute: no receive is in flight
        seen = _Ops()
        with comm.listening(seen), pytest.raises(
            ValueError,
            match=r"stage 0, microbatch 0: input 0 has shape \(2, 5\) float32, "
            r"but the first step's microbatches had \(2, 6\)",
        ):
            schedule.step(torch.randn(8, 5), target=y if num_stages - 1 in owned else None)
        assert seen.ops == [], seen.ops
    # had a receive been left posted, it would take this step's first message from its peer
    again = _step(schedule, owned, num_stages, x, y)
    assert all(torch.equal(a, b) for a, b in zip(first[0], again[0]))
    assert all(torch.equal(a, b) for a, b in zip(first[1], again[1]))
