"""`plait plan --calibrate`: measure this machine's FLOP rate, host cost per op and Gloo's
collective cost, cache it.

    one of the model's blocks, forward and backward, fp32, one thread (as plait's ranks run on a
    shared CPU), at 8 tokens -> op_s: its time over the ops it dispatches (counted with a
    TorchDispatchMode; host time dominates there); at a rank's microbatch shape (b, s, d) ->
    flop_rate: its FLOPs (timing.py's count) over its time less ops * op_s;
    2 processes on Gloo: all-reduce of 4 bytes (latency) and of 4 MiB (bandwidth: bytes sent
    per rank, 2(n-1)/n * S, over the time), and an add on a replicated plait DTensor over the
    2-rank mesh (dtensor_op_s: no communication, plait's dispatch alone) -> Hardware
    -> JSON at $PLAIT_CACHE_DIR or ~/.cache/plait/plan-calibration.json, reused next time

The whole probe stops by its deadline (30 s, process start-up included): each measurement
takes the median of as many repeats as fit its share.
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
    fn()  # warm-up
    times, end = [], time.perf_counter() + budget_s
    while len(times) < max_repeats and (not times or time.perf_counter() < end):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
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


def block_costs(args, *, batch: int, seq_len: int, budget_s: float = 5.0) -> tuple[float, float]:
    """(op_s, flop_rate) from one block's forward + backward at 8 tokens and at (batch, seq_len)."""
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
    t = _timed(step_at(batch, seq_len), 2 * budget_s / 3)
    per_token = 6 * sum(p.numel() for p in block.parameters()) + 12 * args.n_heads * args.head_dim * seq_len
    return op_s, batch * seq_len * per_token / max(t - ops * op_s, 0.1 * t)


def _worker(rank: int, path: str, out: str, budget_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    small, big = torch.zeros(1), torch.zeros(1 << 20)  # 4 bytes, 4 MiB
    lat = _timed(lambda: dist.all_reduce(small), budget_s / 3)
    t_big = _timed(lambda: dist.all_reduce(big), budget_s / 3, max_repeats=10)
    from plait.device_mesh import init_device_mesh
    from plait.tensor import Replicate, distribute_tensor

    d = distribute_tensor(torch.zeros(8, 8), init_device_mesh("cpu", (2,)), [Replicate()])
    dt_op = _timed(lambda: d.add_(1.0), budget_s / 3, max_repeats=2000)
    if rank == 0:
        sent = 2 * (2 - 1) / 2 * big.numel() * 4
        Path(out).write_text(json.dumps({"latency": lat, "bandwidth": sent / max(t_big - lat, 1e-9),
                                         "dtensor_op_s": dt_op}))
    dist.destroy_process_group()


def collective_cost(*, budget_s: float = 15.0) -> tuple[float, float, float]:
    """(latency s, bandwidth bytes/s) of a 2-rank Gloo all-reduce on this host, and the host
    seconds of one op on a plait DTensor."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_worker, args=(os.path.join(tmp, "store"), out, budget_s), nprocs=2,
                           start_method="spawn", join=True)
        found = json.loads(Path(out).read_text())
    return found["latency"], found["bandwidth"], found["dtensor_op_s"]


def calibrate(args, *, batch: int, seq_len: int, refresh: bool = True) -> Hardware:
    """Measure (or, refresh False, read the cache when it exists) and cache."""
    path = cache_path()
    if not refresh and path.exists():
        return Hardware(**{**json.loads(path.read_text()), "source": f"cache {path}"})
    t0 = time.perf_counter()
    op_s, rate = block_costs(args, batch=max(1, batch), seq_len=seq_len, budget_s=DEADLINE_S / 6)
    left = DEADLINE_S - (time.perf_counter() - t0) - 12.0  # spawning 2 processes, importing torch
    latency, bandwidth, dtensor_op_s = collective_cost(budget_s=max(1.0, left))
    hw = Hardware(flop_rate=rate, bandwidth=bandwidth, latency=latency, op_s=op_s, dtensor_op_s=dtensor_op_s,
                  source="calibrated")
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = hw.as_dict()
    fields.pop("source")
    path.write_text(json.dumps(fields, indent=1))
    return Hardware(**{**fields, "source": f"calibrated, cached in {path}"})


def cached() -> Hardware | None:
    path = cache_path()
    if path.exists():
        return Hardware(**{**json.loads(path.read_text()), "source": f"cache {path}"})
    return None
