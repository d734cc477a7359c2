"""Every built-in schedule passes the checker, before and after lowering.

Sizes: p in 2..8 ranks, m in {p, 2p, 4p} microbatches (DualPipeV: 2p and 4p), v = 2 stages
per rank where the schedule interleaves.
"""

import re

import pytest

from plait.pipelining.schedules import (
    SCHEDULES,
    ActionType,
    Schedule,
    build_schedule,
    check,
    looped_1f1b,
    lower,
)

CASES = [
    (name, p, m)
    for name in SCHEDULES
    for p in range(2, 9)
    for m in (p, 2 * p, 4 * p)
    if not (name == "DualPipeV" and m < 2 * p)  # it needs m >= 2p, as torch's does
]


def _cross_rank_pairs(schedule: Schedule) -> int:
    owner = schedule.stage_to_rank
    return sum(owner[s] != owner[s + 1] for s in range(schedule.num_stages - 1))


@pytest.mark.parametrize("name, p, m", CASES)
def test_builtin_schedule_passes_checker_before_and_after_lowering(name, p, m):
    schedule = build_schedule(name, p, m)
    report = check(schedule)
    assert report.num_microbatches == m and not report.lowered
    assert report.num_compute == sum(len(acts) for acts in schedule.actions)

    lowered = lower(schedule)
    report = check(lowered)
    # Deadlock-free even when every SEND/RECV blocks alone, not just batched.
    check(lowered, batch_comms=False)
    # Lowering adds communication only: each rank's compute order is unchanged.
    assert lowered.compute_only() == schedule
    # One forward and one backward message per microbatch across each rank boundary.
    assert report.num_messages == 2 * m * _cross_rank_pairs(schedule)


@pytest.mark.parametrize(
    "name", ["Interleaved1F1B", "LoopedBFS", "Looped1F1B", "InterleavedZeroBubble"]
)
@pytest.mark.parametrize("v", [1, 3])
def test_other_stage_counts_pass(name, v):
    for p in (2, 3, 4):
        schedule = build_schedule(name, p, 2 * p, stages_per_rank=v)
        assert schedule.num_stages == v * p
        check(lower(schedule), batch_comms=False)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_fewer_microbatches_than_ranks(p, m):
    for name in ("GPipe", "1F1B", "ZBVZeroBubble"):
        check(lower(build_schedule(name, p, m)), batch_comms=False)


def test_stage_placement():
    assert build_schedule("Interleaved1F1B", 4, 8).stage_to_rank == (0, 1, 2, 3, 0, 1, 2, 3)
    zbv = build_schedule("ZBVZeroBubble", 4, 8)
    assert zbv.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert all(zbv.stages_of(r) == (r, 7 - r) for r in range(4))


def test_v_turnaround_needs_no_communication():
    p = 4
    lowered = lower(build_schedule("ZBVZeroBubble", p, 8))
    last = lowered.actions[p - 1]
    # Stage p-1 hands its output to stage p on the same rank: no SEND_F/RECV_F between
    # them, and no SEND_B/RECV_B back.
    assert not [a for a in last if a.is_comm and {a.stage, a.peer_stage} == {p - 1, p}]
    assert any(a.kind is ActionType.SEND_F and a.stage == p for a in last)


def test_zero_bubble_splits_backward():
    schedule = build_schedule("InterleavedZeroBubble", 4, 8)
    kinds = {a.kind for acts in schedule.actions for a in acts}
    assert kinds == {ActionType.F, ActionType.I, ActionType.W}


@pytest.mark.parametrize(
    "name, p, m, v, message",
    [
        ("Nope", 2, 2, None, "unknown schedule"),
        ("1F1B", 2, 4, 2, "1 stage(s) per rank"),
        ("GPipe", 0, 4, None, "num_ranks must be >= 1"),
        ("GPipe", 2, 0, None, "num_microbatches must be >= 1"),
        ("Interleaved1F1B", 4, 9, 2, "multiple of its number of rounds"),
        ("Looped1F1B", 4, 6, 2, "multiple of num_ranks(4) that divides num_microbatches(6)"),
        ("Looped1F1B", 4, 2, 2, "multiple of num_ranks(4) that divides num_microbatches(2)"),
    ],
)
def test_bad_arguments_are_user_errors(name, p, m, v, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_schedule(name, p, m, stages_per_rank=v)


@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_looped_1f1b_is_interleaved_1f1b_when_m_is_a_multiple_of_p(p, v):
    """Lamy-Poirier's looped depth-first = Megatron's interleaved 1F1B: rounds of p."""
    for m in (p, 2 * p, 3 * p, 4 * p):
        looped = build_schedule("Looped1F1B", p, m, stages_per_rank=v)
        interleaved = build_schedule("Interleaved1F1B", p, m, stages_per_rank=v)
        assert looped.actions == interleaved.actions
        assert looped.stage_to_rank == interleaved.stage_to_rank
        assert looped.name == "Looped1F1B"


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (3, 6), (3, 12), (4, 8), (4, 16)])
def test_looped_1f1b_rounds_from_depth_first_to_breadth_first(p, m):
    """Every round size g (multiple of p dividing m) passes the checker; g = m takes every
    microbatch through a local stage before the next, in the forward order LoopedBFS uses,
    but interleaves backwards (1F1B) where LoopedBFS runs them all at the end."""
    for g in range(p, m + 1, p):
        if m % g:
            continue
        schedule = looped_1f1b(p, m, stages_per_rank=2, microbatches_per_round=g)
        check(lower(schedule), batch_comms=False)
    bfs, last = build_schedule("LoopedBFS", p, m), looped_1f1b(p, m, microbatches_per_round=m)
    for r in range(p):
        fwd = [a for a in last.actions[r] if a.kind is ActionType.F]
        assert fwd == [a for a in bfs.actions[r] if a.kind is ActionType.F]
        first_b = next(i for i, a in enumerate(last.actions[r]) if a.kind is ActionType.B)
        assert first_b < len(fwd)  # a backward before the last forward: 1F1B, not fill-drain
        assert first_b == m + 2 * (p - 1 - r) + 1  # warm-up: m*(v-1) + 2*(p-1-r), then 1F1B


def test_names_are_case_insensitive():
    assert build_schedule("gpipe", 2, 2) == build_schedule("GPipe", 2, 2)
    assert build_schedule("zbvzerobubble", 2, 4).name == "ZBVZeroBubble"


def test_dualpipev_refuses_fewer_microbatches_than_stages():
    with pytest.raises(ValueError, match=r"num_microbatches\(5\) < 2 \* num_ranks\(3\) = 6"):
        build_schedule("DualPipeV", 3, 5)


def test_dualpipev_reads_torchs_overlapped_pairs():
    """torch's OVERLAP_F_B cell is its two sub-actions, back to back, in a custom schedule."""
    ours = build_schedule("DualPipeV", 2, 4)
    rows = [[str(a) for a in acts] for acts in ours.actions]
    # rank 0 runs F of microbatch 3 on stage 0 with B of microbatch 1 on stage 3 as one pair
    i = rows[0].index("0F3")
    assert rows[0][i + 1] == "3B1"
    rows[0][i : i + 2] = ["(0F3;3B1)OVERLAP_F_B"]
    assert Schedule.from_lists(rows, name="DualPipeV") == ours
    with pytest.raises(ValueError, match="OVERLAP_F_B"):
        Schedule.from_lists([["(0F0;0B0)OVERLAP"]])
