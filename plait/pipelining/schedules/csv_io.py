"""Schedules as CSV, in torch's format: one row per rank, one cell per action (`1F0`).

    row r = rank r's actions in order; an empty cell is torch's idle placeholder (skipped)

Both of torch's flavours read: `compute_only` (F/B/I/W) and `compute_comms` (with
SEND/RECV, and UNSHARD/RESHARD/REDUCE_GRAD). A loaded schedule is a custom schedule like
any other: run it through `check` before trusting it.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from .actions import parse_actions
from .schedule import Schedule, ScheduleError


def schedule_from_csv(
    text: str, *, num_microbatches: int | None = None, name: str = "custom"
) -> Schedule:
    """Parse CSV text; stage placement and (unless given) microbatches are read off it."""
    rows = []
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        parsed = []
        for c, cell in enumerate(row):
            if not cell.strip():
                continue
            try:
                parsed += parse_actions(cell)
            except ValueError as e:
                raise ScheduleError(f"row {r + 1}, column {c + 1}: {e}", rank=r) from None
        rows.append(parsed)
    while rows and not rows[-1]:
        rows.pop()  # trailing blank lines
    if not rows:
        raise ScheduleError("the CSV holds no actions")
    return Schedule.from_lists(rows, num_microbatches=num_microbatches, name=name)


def schedule_to_csv(schedule: Schedule) -> str:
    """CSV text torch's `_load_csv` reads (compute-only or with comms, as the schedule is)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for acts in schedule.actions:
        writer.writerow([str(a) for a in acts])
    return buf.getvalue()


def load_csv(
    path: str | Path, *, num_microbatches: int | None = None, name: str | None = None
) -> Schedule:
    """Read a schedule CSV file (named after the file unless `name` is given)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    return schedule_from_csv(text, num_microbatches=num_microbatches, name=name or path.stem)


def save_csv(schedule: Schedule, path: str | Path) -> Path:
    """Write `schedule` as a CSV file torch can load."""
    path = Path(path)
    path.write_text(schedule_to_csv(schedule), encoding="utf-8")
    return path
