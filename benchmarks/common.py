"""Helpers shared by the benchmarks: medians, ratios and one table format."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist


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


def slowest_rank_time(fn: Callable[[], object], group, batch: int = 1) -> float:
    """Seconds per call of `fn` on the slowest rank of `group`: a barrier, `batch` calls
    back to back, then the max across ranks (one sample)."""
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(batch):
        fn()
    elapsed = torch.tensor([(time.perf_counter() - t0) / batch])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed.item()


def slowest_rank_times(fn: Callable[[], object], group) -> tuple[float, float]:
    """(wall, training-thread CPU) seconds of one call of `fn`, each the slowest rank's of
    `group`, after a barrier. CPU time excludes waiting and other processes' load: it shows
    a wrapper's own overhead even on a busy machine, where wall time mostly measures the
    neighbours."""
    dist.barrier(group=group)
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return elapsed[0].item(), elapsed[1].item()


def alternating_times(ours: Callable[[], object], theirs: Callable[[], object], group, *, warmup: int,
                      rounds: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """`warmup` untimed calls of each, then `rounds` timed calls of each (slowest_rank_times),
    the two alternating who goes first so that neither always runs warm."""
    for _ in range(warmup):
        ours()
        theirs()
    t_ours: list[tuple[float, float]] = []
    t_theirs: list[tuple[float, float]] = []
    for k in range(rounds):
        pair = [(ours, t_ours), (theirs, t_theirs)]
        for fn, times in pair if k % 2 == 0 else pair[::-1]:
            times.append(slowest_rank_times(fn, group))
    return t_ours, t_theirs


def max_over_ranks(value: float, group) -> float:
    """The largest `value` of any rank of `group`."""
    t = torch.tensor([float(value)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()
