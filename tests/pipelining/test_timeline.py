"""Pictures of a simulated schedule: ASCII rows and a standalone SVG."""

import xml.etree.ElementTree as ET

import pytest

from plait.pipelining.schedules import (
    Costs,
    build_schedule,
    render_ascii,
    render_svg,
    simulate,
    write_png,
)

SVG = "{http://www.w3.org/2000/svg}"


def test_ascii_rows_show_every_action_in_order():
    sim = simulate(build_schedule("GPipe", 2, 2))
    lines = render_ascii(sim).splitlines()
    # F = 1 cell, B = 2 cells; rank 0 waits 3 units for rank 1's first backward.
    assert lines[1] == "rank 0 | 0F0 0F1 ............0B0==== 0B1===="
    assert lines[2] == "rank 1 | ....1F0 1F1 1B0==== 1B1==== ........"


def test_ascii_cell_is_the_largest_step_aligning_every_action():
    sim = simulate(build_schedule("1F1B", 2, 2), Costs(forward=1.5, backward=3, weight=1))
    text = render_ascii(sim)
    assert "one cell = 1.5 time unit(s)" in text
    assert "0F0 0F1 " in text


def test_svg_is_well_formed_and_complete():
    sim = simulate(build_schedule("ZBVZeroBubble", 3, 6))
    root = ET.fromstring(render_svg(sim))
    tips = [t.text for t in root.iter(f"{SVG}title")]
    assert tips[0].startswith("ZBVZeroBubble: 3 ranks, 6 stages, 6 microbatches; bubble")
    assert len(tips) == 1 + 3 * 2 * 6 * 3  # title + one per F, I, W
    assert any("rank 2: 3I5 (backward input, stage 3, microbatch 5)" in t for t in tips)


def test_svg_escapes_names():
    schedule = build_schedule("GPipe", 2, 2)
    schedule = type(schedule)(schedule.actions, schedule.stage_to_rank, 2, name="a<b&c")
    ET.fromstring(render_svg(simulate(schedule)))


def test_png_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    path = write_png(simulate(build_schedule("1F1B", 2, 4)), tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
