"""`plait plan pipeline` end to end: check, bubble, peaks, ASCII timeline, SVG."""

import xml.etree.ElementTree as ET

import pytest

from plait.cli import main as plait_main
from plait.pipelining.plan import main as plan_main
from plait.pipelining.schedules import build_schedule, save_csv

SVG = "{http://www.w3.org/2000/svg}"


def test_builtin_schedule_end_to_end(tmp_path, capsys):
    svg = tmp_path / "1f1b.svg"
    argv = ["plan", "pipeline", "--schedule", "1F1B", "--ranks", "4", "--microbatches", "8"]
    assert plait_main([*argv, "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "check: OK" in out
    assert "bubble: 27.27%" in out and "formula: 27.27%" in out
    assert "peak    4   3   2   1" in out
    for r in range(4):
        assert f"rank {r} | " in out
    assert "3F7 3B7==== " in out  # B takes two cells of one time unit

    root = ET.parse(svg).getroot()
    assert root.tag == f"{SVG}svg"
    rects = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    assert len(rects) == 4 * 8 * 2  # one per compute action
    assert "1F1B" in root.find(f"{SVG}title").text


def test_interleaved_with_costs_lowered_and_saved(tmp_path, capsys):
    out_csv = tmp_path / "lowered.csv"
    argv = "pipeline --schedule interleaved1f1b --ranks 2 --microbatches 4 --stages-per-rank 2"
    argv = [*argv.split(), "--costs", "1,3,1", "--lowered", "--save-csv", str(out_csv)]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "4 stages (2 per rank)" in out and "B=3" in out
    assert "lowered (with SEND/RECV):" in out and "0SEND_F0" in out
    assert "SEND_F" in out_csv.read_text()


def test_custom_csv(tmp_path, capsys):
    path = save_csv(build_schedule("ZBVZeroBubble", 2, 4), tmp_path / "mine.csv")
    svg = tmp_path / "mine.svg"
    assert plan_main(["pipeline", "--csv", str(path), "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "schedule: mine, 2 ranks, 4 stages" in out and "check: OK" in out
    ET.parse(svg)


def test_bad_csv_fails_naming_the_action(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    assert plan_main(["pipeline", "--csv", str(path)]) == 1
    out = capsys.readouterr().out
    assert "check: FAILED: rank 0, action #1 (0B0): deadlock" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        ("pipeline --ranks 4", "missing --schedule, --microbatches"),
        ("pipeline --schedule Nope --ranks 2 --microbatches 2", "unknown schedule"),
        ("pipeline --schedule 1F1B --ranks 2 --microbatches 2 --costs 1,2", "costs must be"),
        ("pipeline --schedule 1F1B --ranks 2 --microbatches 2 --csv x.csv", "not both"),
        ("pipeline --csv /nonexistent.csv", "No such file"),
    ],
)
def test_usage_errors_exit_2(argv, message, capsys):
    assert plan_main(argv.split()) == 2
    assert message in capsys.readouterr().err


def test_topics(capsys):
    assert plan_main([]) == 0
    assert "pipeline" in capsys.readouterr().out
    assert plan_main(["nope"]) == 2


def test_dualpipev_plan_draws_every_action(tmp_path, capsys):
    svg = tmp_path / "dualpipev.svg"
    argv = ["plan", "pipeline", "--schedule", "DualPipeV", "--ranks", "4", "--microbatches", "8"]
    assert plait_main([*argv, "--svg", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "schedule: DualPipeV, 4 ranks, 8 stages (2 per rank), 8 microbatches" in out
    assert "check: OK" in out
    assert "bubble: 5.88%" in out  # 12 idle units of 4 x 51 at F=1, I=W=1, B=2
    # rank 0 pairs the forward of one microbatch with the backward of another on its
    # other stage (torch's OVERLAP_F_B): 0F7 then 7B3
    assert "0F7 7B3==== " in out
    root = ET.parse(svg).getroot()
    rects = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    schedule = build_schedule("DualPipeV", 4, 8)
    assert len(rects) == sum(len(a) for a in schedule.actions)  # one per compute action
    assert any(a.kind.value == "I" for acts in schedule.actions for a in acts)
