"""What each compute action waits for: the dataflow of a pipeline.

    F(s, mb)    needs F(s-1, mb)                     (stage s's input activation)
    B|I(s, mb)  needs F(s, mb) and B|I(s+1, mb)      (its saved activations, its output grad)
    W(s, mb)    needs I(s, mb)                       (what I saved for the weight grad)

The first stage's F reads the microbatch itself; the last stage's B|I starts from the loss
its own F computed. Whether stage s+1 ran B or I for a microbatch is read off the schedule,
so a stage may mix split and full backwards across microbatches.
"""

from __future__ import annotations

from .actions import Action, ActionType
from .schedule import Schedule

_F, _B, _I, _W = ActionType.F, ActionType.B, ActionType.I, ActionType.W
_make = Action._make  # skips validation: for actions derived from already valid ones


class Dataflow:
    """The producer/consumer relation of one schedule's compute actions (memoized: the
    checker, simulator and lowering ask about every action several times)."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.last_stage = schedule.num_stages - 1
        # (stage, mb) whose input grad comes from I; otherwise from B, so a missing
        # backward shows up as a wait on an action that never comes.
        self._split = {
            (a.stage, a.microbatch) for acts in schedule.actions for a in acts if a.kind is _I
        }
        self._producers: dict[Action, tuple[Action, ...]] = {}

    def backward(self, stage: int, microbatch: int) -> Action:
        """The action (B or I) computing stage's input grad for microbatch."""
        return _make((stage, _I if (stage, microbatch) in self._split else _B, microbatch))

    def producers(self, action: Action) -> tuple[Action, ...]:
        """The compute actions `action` reads the results of (any rank)."""
        found = self._producers.get(action)
        if found is None:
            found = self._producers[action] = self._find_producers(action)
        return found

    def _find_producers(self, action: Action) -> tuple[Action, ...]:
        s, kind, mb = action
        if kind is _F:
            return (_make((s - 1, _F, mb)),) if s > 0 else ()
        if kind is _B or kind is _I:
            if s < self.last_stage:
                return _make((s, _F, mb)), self.backward(s + 1, mb)
            return (_make((s, _F, mb)),)
        if kind is _W:
            return (_make((s, _I, mb)),)
        return ()

    def transfers(self, action: Action) -> tuple[Action, Action] | None:
        """(SEND, RECV) carrying `action`'s result to another rank, or None if none is needed.

        F's output goes to stage s+1, B|I's input grad to stage s-1; a neighbour on the
        same rank (the V schedule's turn-around) reads it locally, with no communication.
        """
        s, kind, mb = action
        owner = self.schedule.stage_to_rank
        if kind is _F and s < self.last_stage and owner[s + 1] != owner[s]:
            return _make((s, ActionType.SEND_F, mb)), _make((s + 1, ActionType.RECV_F, mb))
        if (kind is _B or kind is _I) and s > 0 and owner[s - 1] != owner[s]:
            return _make((s, ActionType.SEND_B, mb)), _make((s - 1, ActionType.RECV_B, mb))
        return None

    def received_input(self, action: Action) -> Action | None:
        """The RECV that must precede `action` on its rank in a lowered schedule, if any."""
        s, kind, mb = action
        owner = self.schedule.stage_to_rank
        if kind is _F and s > 0 and owner[s - 1] != owner[s]:
            return _make((s, ActionType.RECV_F, mb))
        if (kind is _B or kind is _I) and s < self.last_stage and owner[s + 1] != owner[s]:
            return _make((s, ActionType.RECV_B, mb))
        return None
