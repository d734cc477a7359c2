"""This rank's lowered list, compiled once into the program the runtime steps through.

    lowered actions of rank r --compile (once per plan)--> ops, in the list's order:
        Post(transfers)  a run of consecutive SEND/RECV: one comm.batch_isend_irecv per step;
                         each RECV owns a slot, where its handles wait for the consumer
        Compute(...)     F | B | I | W with its stage, the slot of the receive it reads (-1:
                         none), the local stage it hands its result to (V turn-around)
    bookkeeping actions (UNSHARD, RESHARD, REDUCE_GRAD from torch's CSVs) compile to nothing
    early_recvs=k: every RECV is posted k computes sooner (never ahead of the first compute),
                   at the end of the Post before that compute

Why: a step then does no planning, no dict lookups by action and no dispatch on the action's
kind beyond one flag per op, so the runtime's own cost per action stays small next to the
compute and the p2p it issues (the bubble benchmark counts it in µs per action).

Early receives (Gloo): a Gloo send whose receive is not yet posted only announces itself;
the data leaves when the receiver's notice comes back, a round trip on the critical path
when the receiver posts as it needs the data (1F1B's last stage: RECV_F(i+1) comes after
B(i), just when the previous stage sends it). Posted one compute earlier, the receive is
waiting when the send is issued and the data crosses during that compute. Posting never
blocks and waits stay where they were, so no schedule that passes `check` can deadlock;
every RECV moves by the same rule, so the receives from each peer keep their order (and
sends do not move), and the n-th send from a peer still meets the n-th receive. The cost
is one receive buffer per stage allocated a compute sooner. Not for NCCL, which runs a
pair's sends and receives in order on one stream: a receive moved ahead of a send to the
same peer could wait there for data that is queued behind that send on the other side.

Invariant: a slot is written by exactly one Post and read (emptied) by exactly one Compute
that comes later in the same list: the lowering contract puts each RECV before its consumer
(`schedules/lowering.py`). The slot of a RECV the first step skips (shape inference) stays
empty, and its consumer then waits on nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from plait import comm

from .schedules import Action, ActionType
from .stage import PipelineStage

_F, _B, _I, _W = ActionType.F, ActionType.B, ActionType.I, ActionType.W
_RECV_F, _RECV_B = ActionType.RECV_F, ActionType.RECV_B


@dataclass(frozen=True, slots=True)
class Transfer:
    """One SEND or RECV: `make(mb)` builds its P2POps; a RECV's handles go to `slot`."""

    action: Action
    make: Callable[[int], list[comm.P2POp]]
    microbatch: int
    slot: int  # -1 for a SEND


@dataclass(frozen=True, slots=True)
class Post:
    transfers: tuple[Transfer, ...]


@dataclass(frozen=True, slots=True)
class Compute:
    action: Action
    stage: PipelineStage
    kind: ActionType
    microbatch: int
    wait: int  # the slot of the receive this compute reads; -1 if none
    hand_to: PipelineStage | None  # the next (F) or previous (B|I) stage, when on this rank
    weight_grads: bool  # B or W: one microbatch's weight grads are done after it


@dataclass(frozen=True, slots=True)
class Program:
    ops: tuple[Post | Compute, ...]
    num_slots: int
    computes: Mapping[Action, Compute]  # for the first step's shape inference


def compile_program(
    actions: Sequence[Action], stages: Mapping[int, PipelineStage], *, early_recvs: int = 0
) -> Program:
    """The program for one rank's lowered list (see the module note)."""
    ops: list[Post | Compute] = []
    run: list[Transfer] = []
    slot_of: dict[tuple[int, ActionType, int], int] = {}
    computes: dict[Action, Compute] = {}
    num_slots = 0  # one per receive of the step (a few per microbatch): never reused
    for a in actions:
        s, kind, mb = a
        if a.is_comm:
            stage = stages[s]
            make = {
                ActionType.SEND_F: stage.fwd_send_ops,
                _RECV_F: stage.fwd_recv_ops,
                ActionType.SEND_B: stage.bwd_send_ops,
                _RECV_B: stage.bwd_recv_ops,
            }[kind]
            slot = -1
            if kind is _RECV_F or kind is _RECV_B:
                slot = slot_of[(s, kind, mb)] = num_slots
                num_slots += 1
            run.append(Transfer(a, make, mb, slot))
            continue
        if run:
            ops.append(Post(tuple(run)))
            run = []
        if not a.is_compute:
            continue
        if kind is _F:
            reads, hand_to = (s, _RECV_F, mb), stages.get(s + 1)
        elif kind is _B or kind is _I:
            reads, hand_to = (s, _RECV_B, mb), stages.get(s - 1)
        else:
            reads, hand_to = None, None
        op = Compute(
            a, stages[s], kind, mb, slot_of.pop(reads, -1) if reads else -1, hand_to,
            kind is _B or kind is _W,
        )
        ops.append(op)
        computes[a] = op
    if run:
        ops.append(Post(tuple(run)))
    assert not slot_of, f"receives with no consumer after them: {sorted(map(str, slot_of))}"
    program = _hoist_recvs(ops, early_recvs) if early_recvs else ops
    return Program(tuple(program), num_slots, computes)


def _hoist_recvs(ops: list[Post | Compute], ahead: int) -> list[Post | Compute]:
    """`ops` with every RECV posted `ahead` computes earlier (see the module note).

    A RECV after compute n-1 (n computes before it) is posted just before compute
    max(n - ahead, 1), after the sends already there; the receives gathered before one
    compute keep their order, and targets never decrease along the list, so the order of
    all receives is kept. Sends stay where the lowering put them. Nothing moves ahead of
    the first compute: a step whose first compute refuses its input (stage 0's shape
    check) has then posted no more than before, so nothing of it is left in flight."""
    moved: dict[int, list[Transfer]] = {}
    n = 0
    for op in ops:
        if op.__class__ is Compute:
            n += 1
        else:
            for t in op.transfers:
                if t.slot >= 0:
                    moved.setdefault(max(n - ahead, min(n, 1)), []).append(t)
    out: list[Post | Compute] = []
    n = 0
    for op in ops:
        if op.__class__ is Compute:
            early = tuple(moved.pop(n, ()))
            if early:
                before = out[-1] if out else None
                if before is not None and before.__class__ is Post:
                    out[-1] = Post(before.transfers + early)
                else:
                    out.append(Post(early))
            out.append(op)
            n += 1
            continue
        sends = tuple(t for t in op.transfers if t.slot < 0)
        if sends:
            out.append(Post(sends))
    assert not moved, f"receives left with no compute to post before: {moved}"
    return out
