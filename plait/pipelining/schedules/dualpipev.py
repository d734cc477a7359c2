"""DualPipeV (DeepSeek-V3, arXiv 2412.19437, in its V form) as a pure function.

    rank r owns stages s0 = r (down the V) and s1 = 2p-1-r (back up), like ZBV.
    warm-up   2(p-1-r) x F(s0);  (r+1) x F(s0) F(s1);  (p-1-r) x I(s1) W(s1) F(s1)
    steady    (m-2p+r+1) x [F(s0) B(s1)] [F(s1) B(s0)]       each [..] one OVERLAP_F_B
    cool-down (p-1-r) x B(s1) [F(s1) B(s0)];  (r+1) x B|I(s1) B|I(s0);
              (p-1-r) x W I(s0);  (r+1) x W                  W: oldest pending I first

The steady state pairs the forward of one microbatch with the backward of another on the
same rank: torch writes each pair as one `OVERLAP_F_B` action holding the two sub-actions,
and its runtime runs them one after the other (F, then B). Here the pair is simply its two
actions back to back: the per-rank order, the dataflow and what runs are the same, and every
tool (checker, simulator, lowering, CSV, timeline) reads it with no new action kind. The one
difference from torch's lowering: a SEND of the pair's F goes right after the F, not after
the B (torch adds the sends of both sub-actions after the pair), which only lets the peer
start earlier. Split backward (I then W, zero bubble) fills the warm-up and the second half
of the cool-down; the rest are full backwards.

torch requires m >= 2p (as many microbatches as stages); so does this.
"""

from __future__ import annotations

from collections import deque

from .actions import Action, B, F, I, W
from .schedule import Schedule, v_stage_to_rank


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV on `num_ranks` ranks, two stages each (V placement), torch's order."""
    p, m = num_ranks, num_microbatches
    if p < 1:
        raise ValueError(f"num_ranks must be >= 1, got {p}")
    if m < 2 * p:
        raise ValueError(
            f"DualPipeV needs at least as many microbatches as stages: num_microbatches({m}) "
            f"< 2 * num_ranks({p}) = {2 * p}"
        )
    actions = [_rank_order(r, p, m) for r in range(p)]
    return Schedule(actions, v_stage_to_rank(p, 2 * p), m, "DualPipeV")


def _rank_order(r: int, p: int, m: int) -> list[Action]:
    s0, s1 = r, 2 * p - 1 - r
    fwd = {s0: 0, s1: 0}  # next microbatch to run forward, per stage
    bwd = {s0: 0, s1: 0}  # next microbatch to run B or I, per stage
    pending: deque[tuple[int, int]] = deque()  # (stage, mb) whose I ran and W did not
    ops: list[Action] = []

    def forward(s: int) -> None:
        ops.append(F(s, fwd[s]))
        fwd[s] += 1

    def backward(s: int, split: bool = False) -> None:
        mb = bwd[s]
        bwd[s] += 1
        if split:
            ops.append(I(s, mb))
            pending.append((s, mb))
        else:
            ops.append(B(s, mb))

    def weight() -> None:
        if pending:  # torch skips the slot when no I is waiting
            ops.append(W(*pending.popleft()))

    for _ in range(2 * (p - 1 - r)):
        forward(s0)
    for _ in range(r + 1):
        forward(s0)
        forward(s1)
    for _ in range(p - 1 - r):
        backward(s1, split=True)
        weight()
        forward(s1)
    for _ in range(m - 2 * p + r + 1):  # the overlapped pairs
        forward(s0)
        backward(s1)
        forward(s1)
        backward(s0)
    for _ in range(p - 1 - r):
        backward(s1)
        forward(s1)
        backward(s0)
    # Zero bubble from the middle of this phase on: odd ranks switch before their s1
    # backward, even ranks after it (torch's choice, kept for an equal order).
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(s1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(s0, split)
    for _ in range(p - 1 - r):
        weight()
        backward(s0, split)
    for _ in range(r + 1):
        weight()
    assert not pending and all(fwd[s] == bwd[s] == m for s in (s0, s1)), (r, fwd, bwd, pending)
    return ops

