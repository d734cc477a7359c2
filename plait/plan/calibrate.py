"""`plait plan --calibrate --nproc N`: measure this machine's FLOP rate, host cost per op,
Gloo's cost per call among N processes and a TP rank's cost, cache it per N.

    probe.py's N forked ranks -> per group size g: the cost of a call and the bandwidth among N
      processes; the CPU of one DTensor op; per TP degree and sequence parallel on/off, the TP
      factor, alone and under replicate or fully_shard over the rest (R x T, FSDP x T); per CP
      degree, the CP factor; per group size, the FSDP factor; the contention factor (its
      docstring)
    one of the model's blocks, forward and backward, fp32, one thread, at 8 tokens -> op_s: its
    CPU time (thread time: what a rank's work costs, apart from who else shares the core) over
    the ops it dispatches (counted with a TorchDispatchMode; host time dominates
    there); at a rank's microbatch shape (b, s, d) -> flop_rate: its FLOPs (timing.py's count)
    over its time less ops * op_s; the same block under plait's checkpoint_wrapper -> ac_factor:
    its time over the plain block's (the forward again and the checkpoint's own work)
    -> Hardware(nproc=N, collectives=((g, s per call, bytes/s), ...), p2p, tp_factors=((g, sp,
       factor), ...), tp_ddp_factors and tp_fsdp_factors (the same, R x T and FSDP x T),
       cp_factors=((c, factor), ...), fsdp_factors=((g, factor), ...),
       contention) -> JSON at $PLAIT_CACHE_DIR or ~/.cache/plait/plan-calibration.json,
       {str(N): fields}, reused for jobs of N ranks

The whole calibration stops by its deadline (30 s): the forked ranks are killed past 4/5 of it
(measured quiet, 8 ranks of `small` on 2 cores: they finish in 17-19 s, the block's timings take
the rest).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from plait.plan.hardware import Hardware
from plait.plan.probe import collective_costs

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
    from plait.activation_checkpointing.wrapper import checkpoint_wrapper

    block = checkpoint_wrapper(block)  # as plait train wraps a checkpointed block
    return op_s, rate, _timed(step_at(batch, seq_len), budget_s / 3) / t


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
    for key in ("tp_factors", "tp_ddp_factors", "tp_fsdp_factors", "cp_factors", "fsdp_factors"):
        fields[key] = tuple(tuple(c) for c in fields.get(key, ()))
    return Hardware(**{**fields, "source": source})


def _tp_factors(factors: dict[str, float], prefix: str) -> tuple[tuple[int, bool, float], ...]:
    """((g, sequence parallel, factor), ...) of the probe's "PREFIXg,sp" keys."""
    return tuple(sorted((int(k[len(prefix):].split(",")[0]), k.endswith(",1"), f)
                        for k, f in factors.items() if k.startswith(prefix)))


def _degree_factors(factors: dict[str, float], prefix: str) -> tuple[tuple[int, float], ...]:
    """((degree, factor), ...) of the probe's "PREFIXdegree" keys."""
    return tuple(sorted((int(k[len(prefix):]), f) for k, f in factors.items() if k.startswith(prefix)))


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
    table, dtensor_op_s, factors, contention = ({}, 0.0, {}, 1.0)
    if nproc > 1:  # first: the forked ranks start from a process that has run no torch op yet
        table, dtensor_op_s, factors, contention = collective_costs(nproc, budget_s=DEADLINE_S * 4 / 5,
                                                                    tp=(args, batch, seq_len))
    left = DEADLINE_S - (time.perf_counter() - t0)
    op_s, rate, ac_factor = block_costs(args, batch=max(1, batch), seq_len=seq_len,
                                        budget_s=max(1.0, min(DEADLINE_S / 5, left - 2)))
    first = table[min(table)] if table else (Hardware.latency, Hardware.bandwidth)
    p2p = factors.pop("p2p", 0.0)
    hw = Hardware(flop_rate=rate, bandwidth=first[1], latency=first[0], op_s=op_s,
                  dtensor_op_s=dtensor_op_s or Hardware.dtensor_op_s, nproc=nproc, ac_factor=ac_factor,
                  collectives=tuple((g, c, b) for g, (c, b) in sorted(table.items())), p2p=p2p,
                  tp_factors=_tp_factors(factors, "tp:"), tp_ddp_factors=_tp_factors(factors, "tpddp:"),
                  tp_fsdp_factors=_tp_factors(factors, "tpfsdp:"),
                  cp_factors=_degree_factors(factors, "cp:"), fsdp_factors=_degree_factors(factors, "fsdp:"),
                  contention=contention,
                  source="calibrated")
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
