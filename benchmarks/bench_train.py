"""`plait train` layouts on the same model and global batch: tokens/s and peak memory per rank.

The small config's model (0.8M parameters, byte vocabulary), global batch 16 x 128 tokens, on
1 rank, data parallel (dp_replicate: HSDP with a shard axis of 1), FSDP, TP (+SP), PP (1F1B,
4 microbatches), FSDP x TP, FSDP x PP (4 ranks) and FSDP x TP x PP (8 ranks). Throughput is
the median over the timed steps (the first two, with warm-up, excluded) of the global tokens/s
as the trainer logs it; peak memory the max over ranks of the peak RSS (CPU).

Not here yet (issue 15's second half): the same 2-D and 3-D layouts composed from torch's own
fully_shard + parallelize_module + torch.distributed.pipelining in the same run, for a
plait/torch ratio.
"""

from __future__ import annotations

import statistics
import tempfile

from benchmarks.common import print_table
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


def _train(overrides: list[str]) -> dict:
    from plait.train import apply_overrides, load, train

    job = tempfile.mkdtemp(prefix="plait-bench-train-")
    config = apply_overrides(load("small"), ["--metrics.progress", "false", "--metrics.val_batches", "0",
                                             "--checkpoint.enabled", "false", "--job.dir", job, *overrides])
    result = train(config)
    timed = result.records[2:] or result.records
    return {"tps": statistics.median(r.tokens_per_s for r in timed),
            "mem": max(r.peak_memory_mib for r in result.records), "loss": result.losses[-1]}


def run(quick: bool) -> None:
    steps = 6 if quick else 20
    rows = []
    for name, world, overrides in LAYOUTS:
        got = run_distributed(_train, ["--training.steps", str(steps), *overrides], world_size=world,
                              timeout=600)[0]
        rows.append((name, world, f"{got['tps']:.0f}", f"{got['tps'] / world:.0f}", f"{got['mem']:.0f}",
                     f"{got['loss']:.4f}"))
    print_table(f"plait train, small config, {steps} steps", ("layout", "ranks", "tokens/s", "per rank",
                "peak RSS MiB", f"loss @{steps}"), rows,
                notes="same global batch and data on every layout; the loss column should agree")
