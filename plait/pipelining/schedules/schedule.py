"""A pipeline schedule as data: per rank, the actions it runs, in order.

    generator / CSV / user lists -> Schedule (compute only) -> lower() -> Schedule (with SEND/RECV)
                                          \\-> check() -> simulate() -> timeline

A `Schedule` is immutable. It holds no placeholders for idle time (torch's `None`s): when a
rank waits is the simulator's answer, not part of the schedule. `stage_to_rank[s]` is the
rank that owns stage `s`; every action on stage `s` must sit in that rank's list (the
checker enforces it, with the first offending action named).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .actions import Action, parse_actions


class ScheduleError(ValueError):
    """A schedule that cannot run: names the first bad action, its rank and position."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        index: int | None = None,
        action: Action | None = None,
    ) -> None:
        where = ""
        if rank is not None:
            where = f"rank {rank}"
            if index is not None:
                where += f", action #{index}"
            if action is not None:
                where += f" ({action})"
            where += ": "
        super().__init__(where + message)
        self.rank = rank
        self.index = index
        self.action = action


def loop_stage_to_rank(num_ranks: int, num_stages: int) -> tuple[int, ...]:
    """Stage s on rank s % num_ranks (GPipe, 1F1B, interleaved, looped)."""
    return tuple(s % num_ranks for s in range(num_stages))


def v_stage_to_rank(num_ranks: int, num_stages: int) -> tuple[int, ...]:
    """Stages zig-zag across ranks: 0..p-1 down, p..2p-1 back up, and so on.

    With two stages per rank (ZBV), rank r owns stages r and 2p-1-r, so the turn-around
    from stage p-1 to stage p stays on rank p-1.
    """
    if num_stages % num_ranks:
        raise ValueError(
            f"V-style mapping needs num_stages({num_stages}) divisible by num_ranks({num_ranks})"
        )
    return tuple(
        s % num_ranks if (s // num_ranks) % 2 == 0 else num_ranks - 1 - s % num_ranks
        for s in range(num_stages)
    )


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus the facts needed to read them.

    actions[rank]      the actions `rank` runs, in order (compute only, or lowered)
    stage_to_rank[s]   the rank owning stage s
    num_microbatches   microbatches per step; each stage runs each of them once
    name               the generator's name ("1F1B", ...) or "custom"
    """

    actions: tuple[tuple[Action, ...], ...]
    stage_to_rank: tuple[int, ...]
    num_microbatches: int
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        if not self.actions:
            raise ValueError("a schedule needs at least one rank")
        for rank, acts in enumerate(self.actions):
            for a in acts:
                if not isinstance(a, Action):
                    raise TypeError(
                        f"rank {rank}: {a!r} is not an Action (Schedule.from_lists parses strings)"
                    )
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        for stage, rank in enumerate(self.stage_to_rank):
            if not 0 <= rank < self.num_ranks:
                raise ValueError(
                    f"stage_to_rank[{stage}] = {rank} is not a rank of {self.num_ranks}"
                )

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def is_lowered(self) -> bool:
        """True once SEND/RECV actions are in (see `lower`)."""
        return any(a.is_comm for rank_actions in self.actions for a in rank_actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` owns, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def compute_only(self) -> Schedule:
        """The same schedule without SEND/RECV and bookkeeping actions."""
        return Schedule(
            tuple(tuple(a for a in acts if a.is_compute) for acts in self.actions),
            self.stage_to_rank,
            self.num_microbatches,
            self.name,
        )

    def to_lists(self) -> list[list[str]]:
        """Per rank, the actions in torch's string form (`"1F0"`)."""
        return [[str(a) for a in acts] for acts in self.actions]

    @staticmethod
    def from_lists(
        actions: Sequence[Iterable[Action | str | None]],
        *,
        num_microbatches: int | None = None,
        stage_to_rank: Sequence[int] | None = None,
        name: str = "custom",
    ) -> Schedule:
        """Build a schedule from per-rank lists of `Action`s or strings like `"1F0"`.

        `None` and `""` (torch's idle placeholders) are dropped; torch's OVERLAP_F_B pair
        (`"(0F3;1B1)OVERLAP_F_B"`) becomes its two sub-actions. Unless given, the stage
        mapping is read off the actions (the first rank to mention a stage owns it; the
        checker then flags any other rank touching it) and `num_microbatches` is the
        largest microbatch index plus one.
        """
        parsed: list[tuple[Action, ...]] = []
        for rank_actions in actions:
            row = []
            for a in rank_actions:
                if a is None or (isinstance(a, str) and not a.strip()):
                    continue
                if isinstance(a, Action):
                    row.append(a)
                else:
                    row += parse_actions(a)
            parsed.append(tuple(row))
        if not parsed:
            raise ValueError("a schedule needs at least one rank")
        every = [a for row in parsed for a in row]
        if not every:
            raise ValueError("the schedule has no actions")
        if num_microbatches is None:
            num_microbatches = 1 + max(a.microbatch for a in every if a.microbatch is not None)
        if stage_to_rank is None:
            owner: dict[int, int] = {}
            for rank, row in enumerate(parsed):
                for a in row:
                    owner.setdefault(a.stage, rank)
            num_stages = 1 + max(owner)
            missing = [s for s in range(num_stages) if s not in owner]
            if missing:
                raise ScheduleError(
                    f"stages {missing} appear in no action, but stage {num_stages - 1} does: "
                    "every stage from 0 up needs its actions"
                )
            stage_to_rank = [owner[s] for s in range(num_stages)]
        return Schedule(tuple(parsed), tuple(stage_to_rank), num_microbatches, name)

    def format(self) -> str:
        """One line per rank: `rank 0: 0F0 0F1 0B0 ...`."""
        width = len(str(self.num_ranks - 1))
        return "\n".join(
            f"rank {r:>{width}}: " + " ".join(str(a) for a in acts)
            for r, acts in enumerate(self.actions)
        )
