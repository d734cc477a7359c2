"""The framework's own host cost: plait against torch.distributed's implementation of each
strategy, on a step whose compute is negligible.

    the Llama reference at dim 32, seq 8, 8 layers (benchmarks/host_calls.py), batch 2 per
    rank, world 2 (Gloo, one thread per rank), AdamW
    -> per row, plait's and torch's wrapper on the same initial model, in the same processes:
       DDP, replicate, fully_shard (FSDP2, per block and root), FullyShardedDataParallel
       (FSDP1, transformer auto-wrap), TP + SP (plait's tp_plan, torch's styles, loss parallel),
       and every pipeline schedule (benchmarks.bench_pipelining's transformer at dim 32,
       8 layers, seq 8, 8 microbatches of 1, its split and stage placement)
    -> calls: Python function calls one step makes on rank 0 (sys.setprofile, 'call' events;
       the same on every repeat, independent of load), after warm-up
    -> time: wall ms per step, the slowest rank's, plait and torch alternating, medians
    -> plait train 2-D and 3-D (FSDP 2 x TP 2 and FSDP 2 x PP 2 on 4 ranks; FSDP 2 x TP 2 x
       PP 2 on 8) against benchmarks/train_torch.py (torch's composition of the same layout),
       the same tiny model (dim 32, 8 layers, seq 8, global batch 8): a step is from one
       BatchStream.__next__ to the next (both loops fetch their batch there), so the figures
       cover the whole loop body (clipping, optimizer, the loss and memory all-reduces,
       plait's metrics); calls and wall time are medians over steps 3..N on rank 0

The goal is plait <= torch on both figures on every row. The door (plait.comm, with plait.debug's
default flight recorder listening) is part of plait's row: its per-op cost is plait's cost.
"""

from __future__ import annotations

import time
import warnings
from functools import partial

import torch

from benchmarks import host_calls as hc
from benchmarks.common import alternating_times, max_over_ranks, median, print_table, ratio
from plait import comm
from plait.testing import run_distributed

WORLD = 2
LAYERS = 8
PIPELINE = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
            "DualPipeV")
TRAIN_LAYOUTS = [
    ("train FSDP 2 x TP 2", 4, ["--parallel.dp_shard", "2", "--parallel.tp", "2"]),
    ("train FSDP 2 x PP 2", 4, ["--parallel.dp_shard", "2", "--parallel.pp", "2"]),
    ("train FSDP 2 x TP 2 x PP 2", 8, ["--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.pp", "2"]),
]


# --- the wrappers, plait's and torch's -------------------------------------------------------


def _ddp(lib: str, model):
    if lib == "plait":
        from plait.ddp import DistributedDataParallel
    else:
        from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model)


def _replicate(lib: str, model):
    if lib == "plait":
        from plait.ddp import replicate
    else:
        from torch.distributed._composable import replicate
    return replicate(model)


def _fsdp2(lib: str, model):
    if lib == "plait":
        from plait.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for block in model.layers.values():
        fully_shard(block)
    return fully_shard(model)


def _fsdp1(lib: str, model):
    from plait.models.llama import TransformerBlock

    if lib == "plait":
        import plait.fsdp as fsdp
        import plait.fsdp.wrap as wrap
    else:
        import torch.distributed.fsdp as fsdp
        import torch.distributed.fsdp.wrap as wrap
    policy = partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
    return fsdp.FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"))


_WRAPPERS = {"DDP": _ddp, "replicate": _replicate, "FSDP2 fully_shard": _fsdp2, "FSDP1": _fsdp1}


def _tp_steps(tokens: torch.Tensor, first: str) -> dict:
    import torch.distributed.device_mesh as tdm
    import torch.distributed.tensor.parallel as ttp

    from benchmarks.bench_tp import _loss_parallel, _torch_plan
    from plait.device_mesh import init_device_mesh
    from plait.models.llama import parallelize_llama

    build = {"plait": lambda: parallelize_llama(hc.host_model(LAYERS), init_device_mesh("cpu", (WORLD,)),
                                                sequence_parallel=True),
             "torch": lambda: ttp.parallelize_module(hc.host_model(LAYERS), tdm.init_device_mesh("cpu", (WORLD,)),
                                                     _torch_plan(True))}
    steps = {}
    for lib in _order(first):
        model = build[lib]()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(lib=lib, model=model, opt=opt) -> None:
            logits = model(tokens[:, :-1])
            with _loss_parallel(lib):
                hc.lm_loss(logits, tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[lib] = step
    return steps


def _pipeline_steps(name: str, first: str) -> dict:
    from benchmarks import bench_pipelining as bp
    from plait import pipelining as pp

    torch.manual_seed(0)
    v, _ = bp.SCHEDULES[name]
    num_stages = WORLD * v
    model = bp.Transformer(vocab=64, dim=32, layers=LAYERS, heads=4)
    owned = bp._owned(name, WORLD)
    modules = dict(zip(owned, pp.split_model(model, pp.split_evenly(model, num_stages), owned)))
    ours, theirs = bp._schedules(name, modules, num_stages, bp.lm_loss, first=first)
    tokens = torch.randint(0, 64, (bp.MICROBATCHES, hc.SEQ))
    target = torch.roll(tokens, -1, dims=1)
    return {lib: partial(bp._run_step, s, owned, num_stages, tokens, target)
            for lib, s in (("plait", ours), ("torch", theirs))}


def _wrapped_steps(wrap, tokens: torch.Tensor, first: str) -> dict:
    steps = {}
    for lib in _order(first):
        model = wrap(lib, hc.host_model(LAYERS))
        steps[lib] = hc.train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), tokens)
    return steps


def _order(first: str) -> tuple[str, str]:
    return (first, "torch" if first == "plait" else "plait")


def _row(name: str, build, group, warmup: int, rounds: int, budget: float) -> dict:
    """One row: `build(first)` makes both libraries' steps, the `first` one's model first. It is
    built twice, each library first once, and the times pooled: which model is allocated later
    runs its step up to ~0.1 ms (1-2%) faster at these sizes (the heap's layout; measured with
    the same library on both sides), enough to decide a row. Each build runs at least `rounds`
    // 2 rounds, more where the steps are short enough to fit `budget` seconds: the rows whose
    two sides differ least are the cheapest ones, and their medians need the most samples."""
    times: dict[str, list[tuple[float, float]]] = {"plait": [], "torch": []}
    calls: dict[str, float] = {}
    for first in ("plait", "torch"):
        steps = build(first)
        for _ in range(warmup):
            steps["plait"](), steps["torch"]()
        if not calls:  # counted: the same whichever is built first
            calls = {lib: median([hc.count_calls(fn) for _ in range(3)]) for lib, fn in steps.items()}
        t0 = time.perf_counter()
        steps["plait"](), steps["torch"]()
        pair = max_over_ranks(time.perf_counter() - t0, group)  # every rank runs as many rounds
        n = max((rounds + 1) // 2, min(200, int(budget / 2 / pair)))
        t_ours, t_theirs = alternating_times(steps["plait"], steps["torch"], group, warmup=0, rounds=n)
        times["plait"] += t_ours
        times["torch"] += t_theirs
        del steps
    return {"row": name, "calls": calls, "rounds": len(times["plait"]),
            "ms": {lib: 1e3 * median([t[0] for t in ts]) for lib, ts in times.items()},
            "cpu": {lib: 1e3 * median([t[1] for t in ts]) for lib, ts in times.items()}}


def _measure(quick: bool, only: list[str] | None = None) -> list[dict]:
    warnings.filterwarnings("ignore")
    group = comm.world_group()
    rank = comm.get_rank(group)
    warmup, rounds, budget = (2, 6, 0.0) if quick else (3, 16, 6.0)
    tokens = hc.host_tokens(rank, hc.BATCH)
    out = []
    for name, wrap in _WRAPPERS.items():
        if only is None or name in only:
            out.append(_row(name, partial(_wrapped_steps, wrap, tokens), group, warmup, rounds, budget))
    if only is None or "TP + SP" in only:
        out.append(_row("TP + SP", partial(_tp_steps, hc.host_tokens(0, hc.BATCH)), group, warmup, rounds, budget))
    for name in PIPELINE:
        if only is None or f"PP {name}" in only:
            out.append(_row(f"PP {name}", partial(_pipeline_steps, name), group, warmup, rounds, budget))
    return out


# --- plait train against torch's composition -------------------------------------------------


def _train_overrides(steps: int, layout: list[str]) -> list[str]:
    return ["--training.steps", str(steps), "--training.seq_len", str(hc.SEQ), "--training.batch_size", "8",
            "--model.dim", "32", "--model.n_layers", str(LAYERS), "--model.n_heads", "4", "--model.n_kv_heads", "2",
            "--data.max_bytes", "200000", *layout]


def _train_per_step(lib: str, overrides: list[str], counted: bool) -> list[float]:
    """Per step of one training run on this rank: calls (counted) or wall seconds, each measured
    from one BatchStream.__next__ to the next."""
    import sys

    from benchmarks.bench_train import _config
    from plait.train.data import BatchStream

    marks: list[float] = []
    calls = [0]

    def hook(frame, event, arg):
        if event == "call":
            calls[0] += 1

    original = BatchStream.__next__

    def marked(self):
        marks.append(calls[0] if counted else time.perf_counter())
        return original(self)

    BatchStream.__next__ = marked
    previous = sys.getprofile()
    if counted:
        sys.setprofile(hook)
    try:
        if lib == "plait":
            from plait.train import train

            train(_config(overrides))
        else:
            from benchmarks.train_torch import train_torch

            train_torch(_config(overrides))
    finally:
        sys.setprofile(previous)
        BatchStream.__next__ = original
    return [b - a for a, b in zip(marks, marks[1:])]


def _train_row(name: str, world: int, layout: list[str], quick: bool) -> dict:
    steps = 6 if quick else 12
    overrides = _train_overrides(steps, layout)
    calls, ms = {}, {}
    for lib in ("plait", "torch"):
        counted = run_distributed(_train_per_step, lib, overrides, True, world_size=world, timeout=600)[0]
        timed = run_distributed(_train_per_step, lib, overrides, False, world_size=world, timeout=600)[0]
        calls[lib] = median(counted[2:])
        ms[lib] = 1e3 * median(timed[2:])
    return {"row": name, "calls": calls, "ms": ms}


def measure_all(quick: bool) -> list[dict]:
    rows = run_distributed(_measure, quick, world_size=WORLD, timeout=1800)[0]
    for name, world, layout in TRAIN_LAYOUTS:
        rows.append(_train_row(name, world, layout, quick))
    return rows


def run(quick: bool) -> None:
    import os

    load = os.getloadavg()[0]
    rows = measure_all(quick)
    table = []
    for r in rows:
        c, t = r["calls"], r["ms"]
        table.append((r["row"], f"{c['plait']:.0f}", f"{c['torch']:.0f}", ratio(c["plait"], c["torch"]),
                      f"{t['plait']:.2f}", f"{t['torch']:.2f}", ratio(t["plait"], t["torch"]),
                      *((f"{u['plait']:.2f}", f"{u['torch']:.2f}", ratio(u["plait"], u["torch"])) if (u := r.get("cpu"))
                        else ("-", "-", "-")),
                      str(r.get("rounds", "-")),
                      "yes" if c["plait"] <= c["torch"] and t["plait"] <= t["torch"] else "no"))
    print_table(f"Host cost per step: Llama dim 32, seq {hc.SEQ}, {LAYERS} layers, world {WORLD} "
                f"(train rows: 4 or 8 ranks); load average {load:.2f} at start, {os.getloadavg()[0]:.2f} at end",
                ("row", "plait calls", "torch calls", "calls plait/torch", "plait ms", "torch ms", "ms plait/torch",
                 "plait CPU ms", "torch CPU ms", "CPU plait/torch", "steps timed",
                 "plait <= torch"), table,
                notes="calls: Python function calls per step on rank 0 (sys.setprofile 'call' events), counted; "
                      "ms: slowest rank's wall time per step, median of alternating steps (train rows: rank 0's "
                      "median over steps 3..N of its own run); CPU ms: the training thread's CPU time per step, slowest rank, "
                      "median (waiting and the neighbours' load excluded; not for train rows); steps timed: per library, over two "
                      "builds (each library's model built first once). Wall time on a shared machine measures the "
                      "neighbours too; the calls do not depend on load.")

