"""plait.comm against raw torch.distributed: the door's cost, and the Gloo fast paths.

For each op and size, both run alternately in the same processes (Gloo, one thread per
rank), the order swapped every sample; a sample is the slowest rank's time for a batch of
back-to-back calls (enough for ~20 ms, so scheduler jitter averages out) divided by the
batch, and the table shows medians.
Sizes are the full tensor: the all-reduced / broadcast tensor, the gathered output, the
reduce-scattered input. Bytes are what plait's event reports this rank sent (ring model)
against the op's lower bound: all-reduce 2(N-1)/N·S, all-gather and reduce-scatter
(N-1)/N·S, broadcast S from the source.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from benchmarks.common import human_bytes, median, print_table, ratio, slowest_rank_time
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


def _batch_for(fn, group) -> int:
    """Calls per sample: enough for ~20 ms, agreed by every rank."""
    one = slowest_rank_time(fn, group)
    batch = torch.tensor([max(1, min(200, int(0.02 / max(one, 1e-6))))])
    dist.all_reduce(batch, op=dist.ReduceOp.MIN, group=group)
    return int(batch.item())


def _paired(ours, theirs, group, reps: int) -> tuple[float, float]:
    ours(), theirs()  # warm up both
    batch = _batch_for(theirs, group)
    t_ours, t_theirs = [], []
    for i in range(reps):
        first, second = (ours, theirs) if i % 2 == 0 else (theirs, ours)
        a, b = slowest_rank_time(first, group, batch), slowest_rank_time(second, group, batch)
        t_ours.append(a if first is ours else b)
        t_theirs.append(b if first is ours else a)
    return median(t_ours), median(t_theirs)


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
                t_ours, t_theirs = _paired(ours, theirs, group, reps)
                with CommDebugMode() as mode:
                    ours()
                event = mode.events[0]
                if impl is not None:
                    comm.set_algorithm(op, None)
                rows.append((op, nbytes, name, event.impl, t_ours, t_theirs,
                             event.bytes_sent, _lower_bound(op, n, nbytes)))
    return rows


def _door_cost(reps: int) -> list[tuple]:
    """A tiny all-reduce through plait.comm with the flight recorder on (the default) and
    off, against torch.distributed: what the door itself costs per call."""
    from plait import debug

    warnings.filterwarnings("ignore", category=FutureWarning)
    group = comm.world_group()
    rows = []
    for nbytes in (4, 4 << 10):
        t = torch.ones(max(1, nbytes // 4))
        theirs = lambda t=t: dist.all_reduce(t, group=group)  # noqa: E731
        ours = lambda t=t: comm.all_reduce(t, group=group)  # noqa: E731
        for recorder in (True, False):
            with debug.configured(buffer_size=2000 if recorder else 0):
                t_ours, t_theirs = _paired(ours, theirs, group, reps)
            rows.append((nbytes, "on" if recorder else "off", t_ours, t_theirs))
    return rows


def run(quick: bool) -> None:
    sizes = [4 << 10, 1 << 20, 16 << 20] if quick else [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    impls = {"auto": None, "native": "native", "via all-reduce": "all_reduce"}
    for world in (2, 4):
        reps = 7 if quick else 15
        door = run_distributed(_door_cost, reps, world_size=world, timeout=600)[0]
        print_table(
            f"the door's cost: a small all-reduce, plait.comm vs torch.distributed, Gloo, world size {world}",
            ("size", "flight recorder", "plait µs", "torch µs", "plait/torch"),
            [(human_bytes(b), rec, f"{a * 1e6:.1f}", f"{t * 1e6:.1f}", ratio(a, t)) for b, rec, a, t in door],
            notes="goal: at most 1.02. The recorder is on by default (PLAIT_TRACE_BUFFER_SIZE=0 turns it off).",
        )
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
