"""The simulator against the textbook: bubble formulas and peak activations.

Bubble = idle rank-time / (p * makespan), makespan from the first action's start to the
last action's end. Default costs: F = 1, B = 2; split backward I = 1, W = 1.
"""

import pytest

from plait.pipelining.schedules import (
    Costs,
    ScheduleError,
    bubble_formula,
    build_schedule,
    looped_1f1b,
    lower,
    simulate,
)
from plait.pipelining.schedules.actions import B, F

SIZES = [(p, m) for p in range(2, 9) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p, m", SIZES)
def test_fill_drain_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    sim = simulate(build_schedule(name, p, m))
    assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert sim.bubble == pytest.approx(bubble_formula(name, p, m))
    assert sim.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize("name", ["Interleaved1F1B", "LoopedBFS", "Looped1F1B"])
@pytest.mark.parametrize("p, m", SIZES)
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(name, p, m):
    v = 2
    sim = simulate(build_schedule(name, p, m, stages_per_rank=v))
    assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1))
    assert sim.bubble == pytest.approx(bubble_formula(name, p, m, v))


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p, m", [(p, m) for p in (2, 3, 4) for m in (2 * p, 4 * p)])
def test_looped_1f1b_rounds_keep_the_bubble_and_trade_memory(p, m, v):
    """Any round size g: bubble (p-1)/(vm+p-1); rank r holds min(g(v-1) + 2(p-1-r) + 1, vm)
    microbatch-stages at its peak, where LoopedBFS holds all v*m."""
    bfs = simulate(build_schedule("LoopedBFS", p, m, stages_per_rank=v))
    assert bfs.peak_in_flight_per_rank == (v * m,) * p
    for g in (p, 2 * p, m):
        if m % g:
            continue
        sim = simulate(looped_1f1b(p, m, stages_per_rank=v, microbatches_per_round=g))
        assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1))
        want = tuple(min(g * (v - 1) + 2 * (p - 1 - r) + 1, v * m) for r in range(p))
        assert sim.peak_in_flight_per_rank == want


@pytest.mark.parametrize("p, m", SIZES)
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    one_f_one_b = simulate(build_schedule("1F1B", p, m))
    zb_h1 = simulate(build_schedule("InterleavedZeroBubble", p, m, stages_per_rank=1))
    # Same work per rank (B = I + W), a third of the idle time: (p-1)*F vs (p-1)*(F+B).
    assert sum(zb_h1.idle) == pytest.approx(sum(one_f_one_b.idle) / 3)
    assert one_f_one_b.bubble / 3 < zb_h1.bubble < one_f_one_b.bubble / 2
    # W defers freeing, so later stages hold more than 1F1B's p-i, but never more than
    # 1F1B's worst stage: the same peak memory.
    assert max(zb_h1.peak_in_flight) == max(one_f_one_b.peak_in_flight) == min(p, m)


@pytest.mark.parametrize("p, m", SIZES)
def test_interleaved_zero_bubble_beats_interleaved_1f1b(p, m):
    zb = simulate(build_schedule("InterleavedZeroBubble", p, m))
    assert zb.bubble < simulate(build_schedule("Interleaved1F1B", p, m)).bubble


@pytest.mark.parametrize("p", range(2, 9))
def test_zbv_leaves_only_the_first_forwards_fill(p):
    for m in (2 * p, 4 * p):
        sim = simulate(build_schedule("ZBVZeroBubble", p, m))
        # Each rank idles p-1 units: the time the first microbatch takes to reach the
        # last rank. Work per rank: 2 stages * m * (F + I + W) = 6m.
        assert sim.bubble == pytest.approx((p - 1) / (6 * m + p - 1))
        assert sim.peak_in_flight_per_rank == (2 * p,) * p


@pytest.mark.parametrize("p, m", SIZES)
def test_peak_in_flight(p, m):
    assert simulate(build_schedule("GPipe", p, m)).peak_in_flight == (m,) * p
    assert simulate(build_schedule("1F1B", p, m)).peak_in_flight == tuple(p - i for i in range(p))


def test_peak_in_flight_with_fewer_microbatches_than_ranks():
    assert simulate(build_schedule("1F1B", 4, 2)).peak_in_flight == (2, 2, 2, 1)


def test_lowered_schedule_times_like_its_compute_only_form():
    schedule = build_schedule("Interleaved1F1B", 4, 8)
    assert simulate(lower(schedule)).timeline == simulate(schedule).timeline


def test_timeline_respects_dependencies_and_rank_order():
    sim = simulate(build_schedule("1F1B", 3, 6))
    ends = {slot.action: slot.end for rank in sim.timeline for slot in rank}
    for rank in sim.timeline:
        for before, after in zip(rank, rank[1:]):
            assert before.end <= after.start
    for rank in sim.timeline:
        for slot in rank:
            a = slot.action
            if a.kind.value == "F" and a.stage > 0:
                assert slot.start >= ends[F(a.stage - 1, a.microbatch)]
            if a.kind.value == "B" and a.stage < 2:
                assert slot.start >= ends[B(a.stage + 1, a.microbatch)]
    busy = sum(sim.busy)
    assert sim.bubble == pytest.approx(1 - busy / (3 * sim.makespan))
    assert sum(sim.idle) == pytest.approx(3 * sim.makespan - busy)


def test_costs():
    assert Costs.parse("1,2,1") == Costs()
    assert Costs.parse("1,3,1,0.5") == Costs(1, 3, 1, 0.5)
    assert Costs.parse("1,3,1,0.5,0.1") == Costs(1, 3, 1, 0.5, host=0.1)
    assert Costs(1, 3, 1).of(F(0, 0).kind) == 1
    for bad in ("1,2", "a,b,c", "1,2,2", "0,2,1", "1,2,1,-1", "1,2,1,0,-1", "1,2,1,0,0,1"):
        with pytest.raises(ValueError):
            Costs.parse(bad)


def test_formulas_hold_for_any_uniform_forward_and_backward_cost():
    sim = simulate(build_schedule("1F1B", 4, 8), Costs(forward=1, backward=3, weight=1))
    assert sim.bubble == pytest.approx(3 / 11)
    assert sim.makespan == 4 * 11


def test_communication_latency_widens_the_bubble():
    schedule = build_schedule("1F1B", 4, 8)
    slow = simulate(schedule, Costs(comm=0.5))
    assert slow.bubble > simulate(schedule).bubble
    # At least the 3 forward and 3 backward hops of the critical path's fill and drain.
    assert slow.makespan >= 33 + 0.5 * 2 * 3


def test_host_work_per_action_is_rank_time_that_is_not_compute():
    """Costs.host: each compute action takes its rank `host` before it computes. One rank, m
    microbatches of F = 1, B = 2: the window runs from the first compute to the last, 3m of
    compute and 2m - 1 host gaps; on 4 ranks every compute starts at least `host` after the
    rank's previous one ended, and the bubble is wider than with free host work."""
    m, h = 4, 0.25
    one = simulate(build_schedule("1F1B", 1, m), Costs(host=h))
    assert one.makespan == pytest.approx(3 * m + (2 * m - 1) * h)
    assert one.bubble == pytest.approx(1 - 3 * m / one.makespan)
    assert one.busy == (3 * m,)
    schedule = build_schedule("1F1B", 4, 8)
    sim = simulate(schedule, Costs(host=h))
    for slots in sim.timeline:
        assert all(b.start - a.end >= h - 1e-12 for a, b in zip(slots, slots[1:]))
    assert sim.bubble > simulate(schedule).bubble and sim.busy == simulate(schedule).busy


def test_simulate_checks_first():
    bad = build_schedule("GPipe", 2, 2)
    bad = type(bad)((bad.actions[0], bad.actions[1][:-1]), bad.stage_to_rank, 2)
    with pytest.raises(ScheduleError, match="1B1"):
        simulate(bad)
