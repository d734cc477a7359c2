"""plait.comm against raw torch.distributed: the door's cost, and the Gloo fast paths.

For each op and size, both run alternately in the same processes (Gloo, one thread per
rank); a sample is the slowest rank's time for one call, and the table shows medians.
Sizes are the full tensor: the all-reduced / broadcast tensor, the gathered output, the
reduce-scattered input. Bytes are what plait's event reports this rank sent (ring model)
against the op's lower bound: all-reduce 2(N-1)/N·S, all-gather and reduce-scatter
(N-1)/N·S, broadcast S from the source.
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from benchmarks.common import human_bytes, median, print_table, ratio
from plait import comm
from plait.debug import CommDebugMode
from plait.testing import run_distributed

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def _lower_bound(op: str, n: int, nbytes: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0}[op] * nbytes


def _calls(op: str, nbytes: int, group, n: int):
    """(plait call, torch call) doing the same work on fresh-enough buffers."""
    numel = nbytes // 4
    full = torch.randn(numel)
    piece = torch.randn(numel // n)
    out_full, out_piece = torch.empty(numel), torch.empty(numel // n)
    if op == "all_reduce":
        return (lambda: comm.all_reduce(full, group=group)), (lambda: dist.all_reduce(full, group=group))
    if op == "all_gather":
        return (lambda: comm.all_gather(piece, group=group, out=out_full)), (
            lambda: dist.all_gather_into_tensor(out_full, piece, group=group))
    if op == "reduce_scatter":
        return (lambda: comm.reduce_scatter(full, group=group, out=out_piece)), (
            lambda: dist.reduce_scatter_tensor(out_piece, full, group=group))
    return (lambda: comm.broadcast(full, src=0, group=group)), (lambda: dist.broadcast(full, src=0, group=group))


def _time(fn, group) -> float:
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's time
    return elapsed.item()


def _measure(sizes: list[int], reps: int, impls: dict[str, str | None]) -> list[tuple]:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed collectives
    group = comm.world_group()
    n = comm.get_world_size(group)
    rows = []
    for op in OPS:
        for nbytes in sizes:
            for name, impl in impls.items():
                if impl is not None and op not in ("all_gather", "reduce_scatter"):
                    continue
                if impl is not None:
                    comm.set_algorithm(op, impl)
                ours, theirs = _calls(op, nbytes, group, n)
                ours(), theirs()  # warm up both
                t_ours, t_theirs = [], []
                for _ in range(reps):
                    t_ours.append(_time(ours, group))
                    t_theirs.append(_time(theirs, group))
                with CommDebugMode() as mode:
                    ours()
                event = mode.events[0]
                if impl is not None:
                    comm.set_algorithm(op, None)
                rows.append((op, nbytes, name, event.impl, median(t_ours), median(t_theirs),
                             event.bytes_sent, _lower_bound(op, n, nbytes)))
    return rows


def run(quick: bool) -> None:
    sizes = [4 << 10, 1 << 20, 16 << 20] if quick else [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    impls = {"auto": None, "native": "native", "via all-reduce": "all_reduce"}
    for world in (2, 4):
        reps = 5 if quick else 11
        rows = run_distributed(_measure, sizes, reps, impls, world_size=world, timeout=1800)[0]
        table = []
        for op, nbytes, name, impl, t_ours, t_theirs, sent, bound in rows:
            table.append((op, human_bytes(nbytes), name, impl, f"{t_ours * 1e3:.3f}", f"{t_theirs * 1e3:.3f}",
                          ratio(t_ours, t_theirs), f"{sent / bound:.2f}"))
        print_table(
            f"plait.comm vs torch.distributed, Gloo, world size {world}, median of {reps}",
            ("op", "size", "plait choice", "ran", "plait ms", "torch ms", "plait/torch", "bytes/bound"),
            table,
            notes="'auto' is what plait runs by default (its size table); 'native' and 'via all-reduce' "
                  "force one implementation. torch runs all_gather_into_tensor / reduce_scatter_tensor.",
        )
