"""CSV in torch's format: one row per rank, one action per cell, empty cells skipped."""

import pytest

from plait.pipelining.schedules import (
    SCHEDULES,
    ScheduleError,
    build_schedule,
    check,
    load_csv,
    lower,
    save_csv,
    schedule_from_csv,
    schedule_to_csv,
)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("lowered", [False, True])
def test_round_trip(name, lowered):
    schedule = build_schedule(name, 4, 8)
    if lowered:
        schedule = lower(schedule)
    text = schedule_to_csv(schedule)
    assert len(text.splitlines()) == 4
    assert schedule_from_csv(text, name=name) == schedule


def test_file_round_trip(tmp_path):
    schedule = lower(build_schedule("ZBVZeroBubble", 3, 6))
    path = save_csv(schedule, tmp_path / "zbv.csv")
    loaded = load_csv(path)
    assert loaded.name == "zbv"
    assert loaded.actions == schedule.actions
    assert loaded.stage_to_rank == schedule.stage_to_rank == (0, 1, 2, 2, 1, 0)
    check(loaded)


def test_reads_torchs_idle_cells_and_line_endings():
    text = "0F0,0F1,,0B0,,0B1\r\n,1F0,1B0,1F1,1B1\r\n\r\n"
    schedule = schedule_from_csv(text)
    assert schedule.to_lists() == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    check(schedule)


def test_bookkeeping_actions_load():
    schedule = schedule_from_csv(
        "0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD,0RESHARD\n1RECV_F0,1F0,1B0,1SEND_B0\n"
    )
    check(schedule, batch_comms=False)


def test_a_buggy_csv_is_rejected_by_the_checker(tmp_path):
    path = tmp_path / "custom.csv"
    path.write_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    with pytest.raises(ScheduleError, match="deadlock") as info:
        check(load_csv(path))
    assert info.value.rank == 0 and str(info.value.action) == "0B0"


def test_an_unreadable_cell_names_row_and_column():
    with pytest.raises(ScheduleError, match="row 2, column 3: cannot read action '1Q0'"):
        schedule_from_csv("0F0,0B0\n1F0,1B0,1Q0\n")


def test_empty_csv():
    with pytest.raises(ScheduleError, match="no actions"):
        schedule_from_csv("\n\n")
