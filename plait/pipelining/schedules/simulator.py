"""Time a schedule with per-action costs: each rank's timeline, the bubble, peak memory.

Timing model (dataflow): a rank runs its compute actions in list order; an action starts
when the rank is free and every action it reads (`deps.Dataflow`) has ended, plus
`Costs.comm` when that input comes from another rank. Communication is asynchronous: SEND
and RECV take no rank time, so a lowered schedule times exactly like its compute-only form.
`Costs.host` is the runtime's own work per compute action (taking in its input, dispatch,
posting its output): rank time before the compute that is not compute, so it counts as
bubble, as a measured bubble (time not computing) counts it.

Bubble: over the window from the first compute's start to the last compute's end (the
makespan T, the same window for every rank), the fraction of rank-time not computing:

    bubble = sum_r (T - busy_r) / (p * T)

With unit costs this is (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved.

In flight: microbatch mb is in flight on stage s from the start of F(s, mb) until the end
of the action that frees its activations: B(s, mb), or W(s, mb) when B is split (W still
reads them). A stage lives on one rank, which runs sequentially, so the count depends only
on list order, not on costs. Peaks: 1F1B holds p-s on stage s, GPipe m.
"""

from __future__ import annotations

from dataclasses import dataclass

from .actions import Action, ActionType
from .checker import check
from .deps import Dataflow
from .schedule import Schedule


@dataclass(frozen=True)
class Costs:
    """Time per action. I costs `backward - weight`, so splitting B into I and W keeps its total.

    Defaults: F = 1, B = 2, W = 1 (so I = 1), transfers free, no host work (`host`: the
    runtime's own rank time per compute action, before it).
    """

    forward: float = 1.0
    backward: float = 2.0
    weight: float = 1.0
    comm: float = 0.0
    host: float = 0.0

    def __post_init__(self) -> None:
        if self.forward <= 0 or self.backward <= 0:
            raise ValueError(
                f"forward({self.forward}) and backward({self.backward}) costs must be > 0"
            )
        if not 0 <= self.weight < self.backward:
            raise ValueError(
                f"weight cost({self.weight}) must be in [0, backward({self.backward})): "
                "I costs backward - weight"
            )
        if self.comm < 0 or self.host < 0:
            raise ValueError(f"comm({self.comm}) and host({self.host}) costs must be >= 0")

    @staticmethod
    def parse(text: str) -> Costs:
        """`"F,B,W"` (e.g. `"1,2,1"`), `"F,B,W,comm"` or `"F,B,W,comm,host"`."""
        try:
            values = [float(x) for x in text.split(",")]
        except ValueError:
            raise ValueError(f"costs must be numbers 'F,B,W[,comm[,host]]', got {text!r}") from None
        if len(values) not in (3, 4, 5):
            raise ValueError(f"costs must be 'F,B,W', 'F,B,W,comm' or 'F,B,W,comm,host', got {text!r}")
        return Costs(*values)

    def of(self, kind: ActionType) -> float:
        """Rank time `kind` takes; communication and bookkeeping take none."""
        return {
            ActionType.F: self.forward,
            ActionType.B: self.backward,
            ActionType.I: self.backward - self.weight,
            ActionType.W: self.weight,
        }.get(kind, 0.0)


@dataclass(frozen=True)
class Slot:
    """One compute action on a rank's timeline."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """A schedule's simulated step; see the module docstring for the definitions."""

    schedule: Schedule
    costs: Costs
    timeline: tuple[tuple[Slot, ...], ...]  # per rank, compute actions in order
    makespan: float
    busy: tuple[float, ...]  # per rank
    bubble: float
    peak_in_flight: tuple[int, ...]  # per stage
    peak_in_flight_per_rank: tuple[int, ...]  # all of a rank's stages together

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.makespan - b for b in self.busy)


def bubble_formula(
    name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int = 1
) -> float | None:
    """The textbook bubble with unit costs, or None where there is no closed form here."""
    p, m, v = num_ranks, num_microbatches, stages_per_rank
    key = name.lower()
    if key in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if key in ("interleaved1f1b", "loopedbfs", "looped1f1b"):
        return (p - 1) / (v * m + p - 1)
    return None


def simulate(schedule: Schedule, costs: Costs | None = None) -> Simulation:
    """Check `schedule`, then time it. Raises `ScheduleError` if the check fails."""
    check(schedule)
    costs = costs or Costs()
    flow, owner = Dataflow(schedule), schedule.stage_to_rank
    compute = [[a for a in acts if a.is_compute] for acts in schedule.actions]
    end: dict[Action, float] = {}
    slots: list[list[Slot]] = [[] for _ in compute]
    free = [0.0] * schedule.num_ranks
    pos = [0] * schedule.num_ranks
    progress = True
    while progress:  # the check proved this terminates with every action timed
        progress = False
        for r, acts in enumerate(compute):
            while pos[r] < len(acts) and all(p in end for p in flow.producers(acts[pos[r]])):
                a = acts[pos[r]]
                ready = [
                    end[p] + (costs.comm if owner[p.stage] != r else 0.0) for p in flow.producers(a)
                ]
                start = max([free[r], *ready]) + costs.host
                free[r] = end[a] = start + costs.of(a.kind)
                slots[r].append(Slot(a, start, end[a]))
                pos[r] += 1
                progress = True
    assert all(pos[r] == len(acts) for r, acts in enumerate(compute)), "check() let a deadlock by"

    first = min(s[0].start for s in slots if s)
    makespan = max(s[-1].end for s in slots if s) - first
    busy = tuple(sum(x.end - x.start for x in s) for s in slots)
    bubble = 1.0 - sum(busy) / (schedule.num_ranks * makespan)
    per_stage, per_rank = _peak_in_flight(schedule)
    return Simulation(
        schedule,
        costs,
        tuple(tuple(s) for s in slots),
        makespan,
        busy,
        bubble,
        per_stage,
        per_rank,
    )


def _peak_in_flight(schedule: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Peak microbatches whose activations each stage (and each rank) holds."""
    peak_stage = [0] * schedule.num_stages
    peak_rank = [0] * schedule.num_ranks
    for r, acts in enumerate(schedule.actions):
        held = dict.fromkeys(schedule.stages_of(r), 0)
        for a in acts:
            if a.kind is ActionType.F:
                held[a.stage] += 1
                peak_stage[a.stage] = max(peak_stage[a.stage], held[a.stage])
                peak_rank[r] = max(peak_rank[r], sum(held.values()))
            elif a.kind in (ActionType.B, ActionType.W):  # never both for one mb: checked
                held[a.stage] -= 1
    return tuple(peak_stage), tuple(peak_rank)
