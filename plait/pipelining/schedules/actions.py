"""One step of a pipeline schedule: `(stage, kind, microbatch)`, written like torch's `"1F0"`.

A schedule is, per rank, a list of these. Compute kinds do work on one stage for one
microbatch; communication kinds move that work's result between ranks; bookkeeping kinds
(FSDP/DP) exist only so torch's `compute_comms` CSVs load.

    compute:  F  forward             input activation   -> output activation
              B  full backward       output grad        -> input grad + weight grad
              I  backward for input  output grad        -> input grad   (B split, zero bubble)
              W  backward for weight (saved by I)       -> weight grad  (B split, zero bubble)
    comm:     SEND_F s  stage s sends its F output      to stage s+1's rank
              RECV_F s  stage s receives its F input    from stage s-1's rank
              SEND_B s  stage s sends its input grad    to stage s-1's rank
              RECV_B s  stage s receives its output grad from stage s+1's rank

An `Action` is an immutable, hashable named tuple; `str(a)` and `Action.parse(s)` are inverses and
speak torch's format exactly (`"2I1"`, `"0SEND_F3"`, `"1REDUCE_GRAD"`). torch's OVERLAP_F_B
(`"(0F3;1B1)OVERLAP_F_B"`, DualPipeV) is no kind here: `parse_actions` reads it as its two
sub-actions back to back, which is how torch's runtime runs it.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import NamedTuple


class ActionType(str, Enum):
    """What an action does; the value is torch's spelling in `"1F0"`-style strings."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741  (torch's name for backward-for-input)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"

    # Enum's own __hash__ is Python code; names equal values, so str's C hash agrees with
    # it and with str equality, and makes hashing an Action ~3x cheaper.
    __hash__ = str.__hash__

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return self in _COMM

    @property
    def is_backward(self) -> bool:
        """B or I: the action that consumes the output grad and produces the input grad."""
        return self in (ActionType.B, ActionType.I)


_COMPUTE = frozenset({ActionType.F, ActionType.B, ActionType.I, ActionType.W})
_COMM = frozenset({ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B})
_BOOKKEEPING = frozenset({ActionType.UNSHARD, ActionType.RESHARD, ActionType.REDUCE_GRAD})

# Longest names first so "SEND_F" is not read as "S"... and "B" not as the start of nothing.
_KINDS = "|".join(sorted((k.value for k in ActionType), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KINDS})(\d*)$")


class _Fields(NamedTuple):
    stage: int
    kind: ActionType
    microbatch: int | None


class Action(_Fields):
    """`kind` on `stage` for `microbatch` (None only for bookkeeping kinds).

    A named tuple, like torch's `_Action`: immutable, hashable, cheap to compare, and it
    unpacks as `stage, kind, microbatch = action`.
    """

    __slots__ = ()

    def __new__(cls, stage: int, kind: ActionType | str, microbatch: int | None = None) -> Action:
        if kind.__class__ is not ActionType:
            kind = ActionType(kind)
        if stage < 0:
            raise ValueError(f"action stage must be >= 0, got {stage}")
        if kind in _BOOKKEEPING:
            if microbatch is not None:
                raise ValueError(f"{kind.value} takes no microbatch, got {microbatch}")
        elif microbatch is None or microbatch < 0:
            raise ValueError(f"{kind.value} needs a microbatch >= 0, got {microbatch}")
        return super().__new__(cls, stage, kind, microbatch)

    @staticmethod
    def parse(text: str) -> Action:
        """Read torch's form: `"1F0"`, `"2I1"`, `"0SEND_F3"`, `"1REDUCE_GRAD"`."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot read action {text!r}: expected [stage][kind][microbatch] like '1F0', "
                f"kind one of {[k.value for k in ActionType]}"
            )
        stage, kind, mb = match.groups()
        return Action(int(stage), ActionType(kind), int(mb) if mb else None)

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def is_compute(self) -> bool:
        return self[1] in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return self[1] in _COMM

    @property
    def peer_stage(self) -> int:
        """For a comm action, the stage at the other end of the transfer."""
        if self.kind in (ActionType.SEND_F, ActionType.RECV_B):
            return self.stage + 1
        if self.kind in (ActionType.RECV_F, ActionType.SEND_B):
            return self.stage - 1
        raise ValueError(f"{self} is not a communication action")


def parse_actions(text: str) -> list[Action]:
    """One cell of torch's format as actions: `"1F0"` -> [1F0]; torch's overlapped pair
    `"(0F3;1B1)OVERLAP_F_B"` -> [0F3, 1B1], its sub-actions in the order torch runs them."""
    text = text.strip()
    if text.startswith("("):
        inner, sep, kind = text[1:].partition(")")
        if not sep or kind != "OVERLAP_F_B":
            raise ValueError(
                f"cannot read action {text!r}: a parenthesised cell must be torch's "
                "'(sub;sub)OVERLAP_F_B'"
            )
        subs = [Action.parse(t) for t in inner.split(";") if t.strip()]
        if not subs or not all(a.is_compute for a in subs):
            raise ValueError(f"{text!r}: OVERLAP_F_B holds compute actions only")
        return subs
    return [Action.parse(text)]


def F(stage: int, microbatch: int) -> Action:
    """Forward of `stage` on `microbatch`."""
    return Action(stage, ActionType.F, microbatch)


def B(stage: int, microbatch: int) -> Action:
    """Full backward (input and weight grads) of `stage` on `microbatch`."""
    return Action(stage, ActionType.B, microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: E743
    """Backward for the input grad only (zero-bubble split); its W follows later."""
    return Action(stage, ActionType.I, microbatch)


def W(stage: int, microbatch: int) -> Action:
    """Backward for the weight grad, using what the matching I saved."""
    return Action(stage, ActionType.W, microbatch)
