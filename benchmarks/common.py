"""Helpers shared by the benchmarks: medians, ratios and one table format."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]], notes: str = "") -> None:
    """Print a GitHub-markdown table, so results paste into an issue note as they are."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n### {title}\n")
    for i, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    if notes:
        print(f"\n{notes}")
    print(flush=True)
