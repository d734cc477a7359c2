"""`plait train` layouts on the same model and global batch: tokens/s and peak memory per rank.

The small config's model (0.8M parameters, byte vocabulary), global batch 16 x 128 tokens, on
1 rank, data parallel (dp_replicate alone: plait.ddp.replicate), FSDP, TP (+SP), PP (1F1B,
4 microbatches), FSDP x TP, FSDP x PP (4 ranks) and FSDP x TP x PP (8 ranks). Throughput is
the median over the timed steps (the first two, with warm-up, excluded) of the global tokens/s
as the trainer logs it; peak memory the max over ranks of the peak RSS (CPU).

The 2-D and 3-D layouts (FSDP 2 x TP 2, FSDP 2 x PP 2, FSDP 2 x TP 2 x PP 2) run again in the
same benchmark composed from torch's own init_device_mesh + parallelize_module (the same plan,
SP and loss parallel) + fully_shard per block and root + torch.distributed.pipelining's
PipelineStage and Schedule1F1B with the same microbatches (benchmarks/train_torch.py), on the
same model, init, data stream, optimizer and clipping. The second table prints both runs'
tokens/s and peak memory, their step-1 losses (equal when the comparison is like for like) and
the ratio of step times plait/torch (below 1: plait's step is shorter).
"""

from __future__ import annotations

import statistics
import tempfile

from benchmarks.common import print_table, ratio
from plait.testing import run_distributed

LAYOUTS = [
    ("1 rank", 1, []),
    ("DP (dp_replicate 4)", 4, ["--parallel.dp_replicate", "4", "--parallel.dp_shard", "1"]),
    ("FSDP 4", 4, ["--parallel.dp_shard", "4"]),
    ("TP 4", 4, ["--parallel.tp", "4", "--parallel.dp_shard", "1"]),
    ("PP 4 (1F1B)", 4, ["--parallel.pp", "4", "--parallel.dp_shard", "1"]),
    ("FSDP 2 x TP 2", 4, ["--parallel.dp_shard", "2", "--parallel.tp", "2"]),
    ("FSDP 2 x PP 2", 4, ["--parallel.dp_shard", "2", "--parallel.pp", "2"]),
    ("FSDP 2 x TP 2 x PP 2", 8, ["--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.pp", "2"]),
]
COMPOSED = ("FSDP 2 x TP 2", "FSDP 2 x PP 2", "FSDP 2 x TP 2 x PP 2")  # also run on torch's strategies


def _config(overrides: list[str]):
    from plait.train import apply_overrides, load

    job = tempfile.mkdtemp(prefix="plait-bench-train-")
    return apply_overrides(load("small"), ["--metrics.progress", "false", "--metrics.val_batches", "0",
                                           "--checkpoint.enabled", "false", "--job.dir", job, *overrides])


def _train(overrides: list[str]) -> dict:
    from plait.train import train

    result = train(_config(overrides))
    timed = result.records[2:] or result.records
    return {"tps": statistics.median(r.tokens_per_s for r in timed),
            "mem": max(r.peak_memory_mib for r in result.records), "loss": result.losses[-1],
            "loss1": result.losses[0]}


def _train_torch(overrides: list[str]) -> dict:
    from benchmarks.train_torch import train_torch

    got = train_torch(_config(overrides))
    return {"tps": statistics.median(got["tps"][2:] or got["tps"]), "mem": got["mem"],
            "loss": got["losses"][-1], "loss1": got["losses"][0]}


def run(quick: bool) -> None:
    steps = 6 if quick else 20
    rows, composed = [], []
    for name, world, overrides in LAYOUTS:
        args = ["--training.steps", str(steps), *overrides]
        got = run_distributed(_train, args, world_size=world, timeout=600)[0]
        if name in COMPOSED:
            ref = run_distributed(_train_torch, args, world_size=world, timeout=600)[0]
            composed.append((name, world, f"{got['tps']:.0f}", f"{ref['tps']:.0f}", f"{got['mem']:.0f}",
                             f"{ref['mem']:.0f}", f"{got['loss1']:.6f}", f"{ref['loss1']:.6f}",
                             f"{got['loss']:.4f} / {ref['loss']:.4f}", ratio(ref["tps"], got["tps"])))
        rows.append((name, world, f"{got['tps']:.0f}", f"{got['tps'] / world:.0f}", f"{got['mem']:.0f}",
                     f"{got['loss']:.4f}"))
    print_table(f"plait train, small config, {steps} steps", ("layout", "ranks", "tokens/s", "per rank",
                "peak RSS MiB", f"loss @{steps}"), rows,
                notes="same global batch and data on every layout; the loss column should agree")
    print_table(f"plait vs torch's composed strategies, small config, {steps} steps",
                ("layout", "ranks", "plait tok/s", "torch tok/s", "plait RSS MiB", "torch RSS MiB",
                 "plait loss @1", "torch loss @1", f"loss @{steps} plait / torch", "step time plait/torch"),
                composed, notes="torch: init_device_mesh + parallelize_module + fully_shard + pipelining "
                "Schedule1F1B (benchmarks/train_torch.py); step time ratio below 1: plait's step is shorter; "
                "the step-1 losses must agree (same init and batch), else the comparison is wrong")
