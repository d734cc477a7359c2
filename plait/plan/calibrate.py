"""`plait plan --calibrate --nproc N`: measure this machine's FLOP rate, host cost per op and
Gloo's cost per call among N processes, cache it per N.

    N processes forked from this one (torch imported, no op run yet: fork-safe, no start-up to
    wait for), one thread each, as plait train runs N ranks here: in step, each computes a burst
    (two 256x128 @ 128x512 matmuls, ~1 ms: the small config's ranks compute 0.6-1.8 ms between
    calls) then calls an all-reduce over its group of g consecutive ranks, every group of that
    size at once, for each g dividing N; the variants alternate over ROUNDS rounds ->
      per call (s), per g: the wall a 4-byte call adds over the bursts alone: its CPU, stretched
        by the ranks sharing a core, and the waits for its group's ranks to be scheduled
      bandwidth (bytes/s per rank), per g: a 1 MiB all-reduce's ring bytes per rank,
        2(g-1)/g * S, over the wall it adds beyond the 4-byte call
      dtensor_op_s: the CPU (thread time, not wall) of an add on a replicated plait DTensor over
        the N-rank mesh: plait's dispatch alone
    one of the model's blocks, forward and backward, fp32, one thread, at 8 tokens -> op_s: its
    CPU time (thread time: what a rank's work costs, apart from who else shares the core) over
    the ops it dispatches (counted with a TorchDispatchMode; host time dominates
    there); at a rank's microbatch shape (b, s, d) -> flop_rate: its FLOPs (timing.py's count)
    over its time less ops * op_s; the same block under plait's checkpoint_wrapper -> ac_factor:
    its time over the plain block's (the forward again and the checkpoint's own work)
    -> Hardware(nproc=N, collectives=((g, s per call, bytes/s), ...)) -> JSON at $PLAIT_CACHE_DIR
       or ~/.cache/plait/plan-calibration.json, {str(N): fields}, reused for jobs of N ranks

The whole probe stops by its deadline (30 s): the forked ranks are killed past half of it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from plait.plan.timing import Hardware

DEADLINE_S = 30.0


def cache_path() -> Path:
    root = os.environ.get("PLAIT_CACHE_DIR") or Path.home() / ".cache" / "plait"
    return Path(root) / "plan-calibration.json"


def _timed(fn, budget_s: float, *, max_repeats: int = 50) -> float:
    """Median CPU seconds (this thread's, so another process's load does not count) of `fn`."""
    fn()  # warm-up
    times, end = [], time.perf_counter() + budget_s
    while len(times) < max_repeats and (not times or time.perf_counter() < end):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def matmul_flop_rate(tokens: int, dim: int, hidden: int, *, budget_s: float = 5.0) -> float:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(tokens, dim), torch.randn(dim, hidden)
    return 2 * tokens * dim * hidden / _timed(lambda: a @ b, budget_s)


def count_ops(fn) -> int:
    """Aten ops `fn` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as c:
        fn()
    return c.n


def block_costs(args, *, batch: int, seq_len: int, budget_s: float = 5.0) -> tuple[float, float, float]:
    """(op_s, flop_rate, ac_factor) from one block's forward + backward at 8 tokens and at (batch,
    seq_len), and the same block checkpointed at (batch, seq_len) over it plain."""
    import torch

    from plait.models.llama.model import TransformerBlock, rope_table

    torch.set_num_threads(1)
    block = TransformerBlock(0, args)

    def step_at(b: int, s: int):
        rope = rope_table(args.head_dim, s, args.rope_theta)
        x = torch.randn(b, s, args.dim, requires_grad=True)
        return lambda: block(x, rope).sum().backward()

    small = step_at(1, min(8, seq_len))
    ops = count_ops(small)
    op_s = _timed(small, budget_s / 3)
    op_s /= ops
    t = _timed(step_at(batch, seq_len), budget_s / 3)
    per_token = 6 * sum(p.numel() for p in block.parameters()) + 12 * args.n_heads * args.head_dim * seq_len
    rate = batch * seq_len * per_token / max(t - ops * op_s, 0.1 * t)
    from plait.activation_checkpoint import checkpoint_wrapper

    block = checkpoint_wrapper(block)  # as plait train wraps a checkpointed block
    return op_s, rate, _timed(step_at(batch, seq_len), budget_s / 3) / t


BURST = (256, 128, 512)  # (m, k, n): one matmul of 2mkn = 34 MFLOP, ~0.5 ms on one core of this host
BURSTS_PER_CALL = 2  # ~1 ms of compute between calls: the small config's ranks compute 0.6 (TP) to 1.8 ms (FSDP)
ROUNDS = 5  # the variants alternate, ROUNDS times
BIG = 1 << 18  # floats: the 1 MiB all-reduce that gives the bandwidth at the job's process count


def group_sizes(nproc: int) -> list[int]:
    """The group sizes a layout of `nproc` ranks can use: every divisor above 1."""
    return [g for g in range(2, nproc + 1) if nproc % g == 0]


def _rank(rank: int, nproc: int, store: str, out: str, repeats: int) -> None:
    """One of the probe's processes (forked from the calibrating one): every rank, in step,
    computes a burst and calls a collective over its group of g consecutive ranks (all groups of
    that size at once, as a layout's axis does); the extra wall time over the bursts alone, per
    call, is what a call costs among `nproc` processes on these cores."""
    import torch

    from plait import comm

    torch.set_num_threads(1)  # as plait train sets it when the ranks outnumber the cores
    comm.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=nproc)
    world = comm.world_group()
    sizes = group_sizes(nproc)
    groups = {g: world if g == nproc else comm.new_group(list(range(rank // g * g, rank // g * g + g)))
              for g in sizes}
    a, w = torch.randn(*BURST[:2]), torch.randn(*BURST[1:])
    small, big = a.new_zeros(1), a.new_zeros(BIG)  # 4 bytes, 1 MiB

    def loop(group, tensor) -> float:
        comm.barrier(group=world)
        t0 = time.perf_counter()
        for _ in range(repeats):
            for _ in range(BURSTS_PER_CALL):
                a @ w
            if group is not None:
                comm.all_reduce(tensor, group=group)
        return (time.perf_counter() - t0) / repeats

    variants = {"bursts": (None, None), **{f"small{g}": (groups[g], small) for g in sizes},
                **{f"big{g}": (groups[g], big) for g in sizes}}
    found = dict.fromkeys(variants, 0.0)
    for _ in range(ROUNDS):  # each variant in every round: a change in the host's load falls on all alike
        for key, (group, tensor) in variants.items():
            found[key] += loop(group, tensor) / ROUNDS
    from plait.device_mesh import init_device_mesh
    from plait.tensor import Replicate, distribute_tensor

    d = distribute_tensor(torch.zeros(8, 8), init_device_mesh("cpu", (nproc,)), [Replicate()])
    d.add_(1.0)
    c0 = time.thread_time()  # CPU, not wall: the host cost of an op, apart from time-sharing
    for _ in range(200):
        d.add_(1.0)
    found["dtensor_op_s"] = (time.thread_time() - c0) / 200
    Path(out).write_text(json.dumps(found))
    comm.barrier(group=world)
    comm.destroy_process_group()


def collective_costs(nproc: int, *, budget_s: float = 15.0,
                     repeats: int = 10) -> tuple[dict[int, tuple[float, float]], float]:
    """({group size: (seconds per call, bytes/s per rank)} among `nproc` processes on this host,
    each rank computing between calls; host seconds of one plait DTensor op), from `nproc`
    processes forked from this one (torch already imported: no start-up to wait for). The
    figures are the mean over ranks; a call's cost is its extra wall time over the bursts alone,
    so it holds the call's own CPU, stretched by the ranks sharing a core, and the waits for the
    group's ranks to be scheduled."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(nproc)]
        procs = [ctx.Process(target=_rank, args=(r, nproc, os.path.join(tmp, "store"), outs[r], repeats))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        deadline = time.perf_counter() + budget_s
        for p in procs:
            p.join(max(0.1, deadline - time.perf_counter()))
        late = [p for p in procs if p.is_alive()]
        for p in late:
            p.kill()
            p.join()
        if late or any(p.exitcode for p in procs):
            raise RuntimeError(f"plait plan --calibrate: the {nproc}-process collective probe did not finish in "
                               f"{budget_s:.0f} s (exit codes {[p.exitcode for p in procs]})")
        found = [json.loads(Path(o).read_text()) for o in outs]
    mean = lambda key: statistics.mean(f[key] for f in found)  # noqa: E731
    table = {}
    for g in group_sizes(nproc):
        call = max(0.0, mean(f"small{g}") - mean("bursts"))
        sent = 2 * (g - 1) / g * BIG * 4  # per rank, the ring all-reduce's count
        # the bytes' time: the big call's over the small one's, at least a tenth of the big call
        # (on a loaded host the difference of two noisy figures can come out at nothing)
        moving = max(mean(f"big{g}") - mean(f"small{g}"), 0.1 * (mean(f"big{g}") - mean("bursts")), 1e-6)
        table[g] = (call, sent / moving)
    return table, mean("dtensor_op_s")


def _read_cache() -> dict:
    path = cache_path()
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {} if "flop_rate" in found else found  # a flat file is the earlier, 2-process format: measure again


def _hardware(fields: dict, source: str) -> Hardware:
    fields = dict(fields)
    fields["collectives"] = tuple(tuple(c) for c in fields.get("collectives", ()))
    return Hardware(**{**fields, "source": source})


def calibrate(args, *, batch: int, seq_len: int, nproc: int, refresh: bool = True) -> Hardware:
    """Measure this host for a job of `nproc` ranks (or, refresh False, read the cache when it
    holds that process count) and cache it under the process count."""
    path = cache_path()
    entries = _read_cache()
    if not refresh and str(nproc) in entries:
        return _hardware(entries[str(nproc)], f"cache {path}")
    import plait.comm  # noqa: F401 - imported once here, not in each forked rank
    import plait.tensor  # noqa: F401

    t0 = time.perf_counter()
    table, dtensor_op_s = ({}, 0.0)
    if nproc > 1:  # first: the forked ranks start from a process that has run no torch op yet
        table, dtensor_op_s = collective_costs(nproc, budget_s=DEADLINE_S / 2)
    left = DEADLINE_S - (time.perf_counter() - t0)
    op_s, rate, ac_factor = block_costs(args, batch=max(1, batch), seq_len=seq_len,
                                        budget_s=min(DEADLINE_S / 5, left - 2))
    first = table[min(table)] if table else (Hardware.latency, Hardware.bandwidth)
    hw = Hardware(flop_rate=rate, bandwidth=first[1], latency=first[0], op_s=op_s,
                  dtensor_op_s=dtensor_op_s or Hardware.dtensor_op_s, nproc=nproc, ac_factor=ac_factor,
                  collectives=tuple((g, c, b) for g, (c, b) in sorted(table.items())), source="calibrated")
    fields = hw.as_dict()
    fields.pop("source")
    entries[str(nproc)] = fields
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=1))
    return _hardware(fields, f"calibrated in {time.perf_counter() - t0:.0f} s, cached in {path}")


def cached(nproc: int) -> Hardware | None:
    """The cached calibration for a job of `nproc` ranks, if there is one."""
    entry = _read_cache().get(str(nproc))
    return _hardware(entry, f"cache {cache_path()}") if entry else None
