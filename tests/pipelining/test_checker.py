"""Planted mistakes are rejected, naming the first bad action and its rank."""

import pytest

from plait.pipelining.schedules import (
    Action,
    ActionType,
    Schedule,
    ScheduleError,
    build_schedule,
    check,
    lower,
)


def _schedule(*rows: str, **kwargs) -> Schedule:
    """A schedule from one string per rank: `_schedule("0F0 0B0", "1F0 1B0")`."""
    return Schedule.from_lists([row.split() for row in rows], **kwargs)


def _edit(schedule: Schedule, rank: int, edit) -> Schedule:
    """`schedule` with rank's list replaced by edit(list of action strings)."""
    lists = schedule.to_lists()
    lists[rank] = edit(lists[rank])
    return Schedule.from_lists(
        lists, num_microbatches=schedule.num_microbatches, stage_to_rank=schedule.stage_to_rank
    )


def _without(*names: str):
    return lambda row: [a for a in row if a not in names]


def _rejects(schedule: Schedule, action: str, rank: int, match: str, **kwargs) -> ScheduleError:
    with pytest.raises(ScheduleError, match=match) as info:
        check(schedule, **kwargs)
    err = info.value
    assert err.action == Action.parse(action), str(err)
    assert err.rank == rank, str(err)
    assert action in str(err) and f"rank {rank}" in str(err)
    return err


def test_missing_backward():
    bad = _edit(build_schedule("1F1B", 4, 4), 2, _without("2B1"))
    err = _rejects(bad, "2B1", 2, "missing 2B1")
    assert "2F1" in str(err)  # the forward left without its backward


def test_missing_weight_grad():
    bad = _edit(build_schedule("InterleavedZeroBubble", 2, 2), 1, _without("3W0"))
    _rejects(bad, "3W0", 1, "missing 3W0")


def test_send_with_no_receive():
    lowered = lower(build_schedule("1F1B", 4, 8))
    bad = _edit(lowered, 1, _without("1RECV_F2"))
    _rejects(bad, "0SEND_F2", 0, "has no matching 1RECV_F2 on rank 1")


def test_receive_with_no_send():
    lowered = lower(build_schedule("1F1B", 2, 2))
    bad = _edit(lowered, 1, _without("1SEND_B0"))
    _rejects(bad, "0RECV_B0", 0, "has no matching 1SEND_B0 on rank 1")


def test_transfer_with_neither_send_nor_receive():
    lowered = lower(build_schedule("1F1B", 2, 2))
    bad = _edit(_edit(lowered, 0, _without("0SEND_F1")), 1, _without("1RECV_F1"))
    _rejects(bad, "0F1", 0, "no 0SEND_F1 / 1RECV_F1 carries it")


def test_cycle_in_compute_order():
    # Rank 0 wants microbatch 0 back before sending microbatch 1; rank 1 insists on 1 first.
    bad = _schedule("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0")
    err = _rejects(bad, "0B0", 0, "deadlock")
    assert "rank 1 at 1F1 (#0) waits for 0F1 on rank 0" in str(err)


def test_cycle_in_communication_order():
    # Rank 0 waits for a gradient before sending the activation that produces it.
    bad = _schedule(
        "0F0 0RECV_B0 0B0 0SEND_F0",
        "1RECV_F0 1F0 1B0 1SEND_B0",
    )
    err = _rejects(bad, "0RECV_B0", 0, "deadlock")
    assert "rank 1 at 1RECV_F0 (#0) waits for 0SEND_F0 on rank 0" in str(err)


def test_three_rank_cycle_names_every_link():
    bad = _schedule("0F0 0B0", "1F0 1B0", "2B0 2F0")
    with pytest.raises(ScheduleError, match="runs before 2F0"):
        check(bad)  # a local misorder is named before it can look like a deadlock


def test_batched_send_recv_pairs_do_not_deadlock_but_lone_ones_do():
    # Megatron's 1F1B: each rank sends its result and receives the next input in one
    # batch. Posted one op at a time it would hang; posted together it runs.
    fused = _schedule(
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    )
    check(fused, batch_comms=True)
    _rejects(fused, "0SEND_F1", 0, "deadlock", batch_comms=False)


def test_messages_must_match_in_order():
    lowered = lower(build_schedule("1F1B", 2, 4))

    def swap(row):
        i, j = row.index("1RECV_F0"), row.index("1RECV_F1")
        row[i], row[j] = row[j], row[i]
        return row

    _rejects(_edit(lowered, 1, swap), "0SEND_F0", 0, "match in the order")


def test_receive_after_its_consumer():
    bad = _schedule("0F0 0SEND_F0 0RECV_B0 0B0", "1F0 1RECV_F0 1B0 1SEND_B0")
    _rejects(bad, "1F0", 1, "runs before 1RECV_F0")


def test_send_before_its_compute():
    lowered = lower(build_schedule("1F1B", 2, 2))

    def early(row):
        row.remove("0SEND_F0")
        row.insert(0, "0SEND_F0")
        return row

    _rejects(_edit(lowered, 0, early), "0SEND_F0", 0, "sends before 0F0")


def test_local_transfer_needs_no_communication():
    zbv = lower(build_schedule("ZBVZeroBubble", 2, 4))
    bad = _edit(zbv, 1, lambda row: [*row, "1SEND_F0"])
    _rejects(bad, "1SEND_F0", 1, "local transfer needs no SEND_F")


@pytest.mark.parametrize(
    "rows, action, rank, match",
    [
        (("0F0 0F0 0B0", "1F0 1B0"), "0F0", 0, "runs twice"),
        (("0B0 0F0", "1F0 1B0"), "0B0", 0, "runs before 0F0"),
        (("0F0 0I0 0B0", "1F0 1B0"), "0B0", 0, "B or I, not both"),
        (("0F0 0W0 0I0", "1F0 1B0"), "0W0", 0, "runs before 0I0"),
        (("0F0 0B0 0W0", "1F0 1B0"), "0W0", 0, "already computed"),
        (("0F0 0B0 1B0", "1F0 1B0"), "1F0", 1, "belongs to rank 0"),
        (("0F0 0B0 0F1", "1F0 1B0"), "0F1", 0, "microbatch 1 does not exist"),
        (("0F0 0B0 2F0", "1F0 1B0"), "2F0", 0, "stage 2 does not exist"),
        (("0F0 0B0", "1F0 1B0 1SEND_F0"), "1SEND_F0", 1, "no stage 2"),
    ],
)
def test_local_mistakes(rows, action, rank, match):
    kwargs = {"num_microbatches": 1}
    if "2F0" in rows[0]:
        kwargs["stage_to_rank"] = (0, 1)
    _rejects(_schedule(*rows, **kwargs), action, rank, match)


def test_missing_forward_of_a_whole_microbatch():
    bad = _schedule("0F0 0B0", "1F0 1B0", num_microbatches=2)
    err = _rejects(bad, "0F1", 0, "never runs the forward of microbatch 1")
    assert err.index is None


def test_missing_stage_is_reported_when_reading_lists():
    with pytest.raises(ScheduleError, match=r"stages \[1\] appear in no action"):
        _schedule("0F0 0B0", "2F0 2B0")


def test_first_bad_action_is_lowest_rank_then_earliest():
    bad = _schedule("0F0 0F0 0B0", "1B0 1F0")
    _rejects(bad, "0F0", 0, "runs twice")


def test_report_describes_what_was_checked():
    report = check(lower(build_schedule("ZBVZeroBubble", 2, 4)))
    assert (report.num_ranks, report.num_stages, report.num_microbatches) == (2, 4, 4)
    # Stage 0->1 and 2->3 cross ranks; 1->2 is the V's local turn-around.
    assert report.num_messages == 2 * 2 * 4
    assert str(report).startswith("OK:")


def test_custom_lists_go_through_the_same_checker():
    custom = Schedule.from_lists(
        [["0F0", None, "0F1", "", "0B0", "0B1"], [Action(1, ActionType.F, 0), "1B0", "1F1", "1B1"]]
    )
    assert custom.num_microbatches == 2 and custom.stage_to_rank == (0, 1)
    check(custom)
    check(lower(custom), batch_comms=False)
