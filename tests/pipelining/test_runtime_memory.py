"""Activations live exactly as long as the simulator says: peak in flight per stage, measured.

Each stage saves one marker tensor per microbatch for its backward (the input of a
multiply by a weight). It is alive exactly while that microbatch's graph is: from F until
B, or until W when the backward is split (I must keep what W needs). Counting live markers
after every forward gives each stage's peak, which must equal `simulate(...)`'s
`peak_in_flight` (GPipe m, 1F1B p - s, ...), and after the step none may be left, freed
by reference counting alone (no gc.collect: a cycle would keep activations until the next
garbage collection).
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.pipelining import PipelineStage, build_schedule, simulate
from plait.testing import distributed

from .test_runtime_parity import SCHEDULES

MICROBATCHES = 8


class Marked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.markers: list[weakref.ref] = []
        self.peak = 0

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.markers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marker = torch.tanh(x)  # saved by the multiply below, for w's grad
        self.markers.append(weakref.ref(marker))
        out = marker * self.w
        self.peak = max(self.peak, self.alive())
        return out


@distributed([2, 4])
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_peak_activations_per_stage_match_the_simulator(schedule_name):
    group = comm.world_group()
    rank, p = comm.get_rank(group), comm.get_world_size(group)
    cls, v = SCHEDULES[schedule_name]
    plan = build_schedule(schedule_name, p, MICROBATCHES, stages_per_rank=v if v > 1 else None)
    owned = list(plan.stages_of(rank))
    modules = {s: Marked() for s in owned}
    stages = [PipelineStage(modules[s], s, p * v, "cpu") for s in owned]
    schedule = cls(stages[0] if v == 1 else stages, MICROBATCHES, loss_fn=F.mse_loss)
    x, y = torch.randn(2 * MICROBATCHES, 4), torch.randn(2 * MICROBATCHES, 4)
    expected = simulate(plan).peak_in_flight
    for _ in range(2):  # the first step also infers shapes
        for m in modules.values():
            m.markers.clear()
            m.peak = 0
        schedule.step(*((x,) if 0 in owned else ()), target=y if p * v - 1 in owned else None)
        for s, m in modules.items():
            assert m.peak == expected[s], (
                f"stage {s}: peak {m.peak} alive, simulator says {expected[s]}"
            )
            assert m.alive() == 0, (
                f"stage {s}: {m.alive()} microbatches' activations outlive the step"
            )
