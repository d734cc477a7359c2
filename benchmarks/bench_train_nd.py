"""FSDP x TP and HSDP x TP step time, plait against torch's own composition, and the bytes
each rank sends per step counted at plait's door against plait.plan's formula.

    the small config, FSDP 2 x TP 2 (4 ranks) and HSDP dp_replicate 2 x dp_shard 2 x TP 2 (8 ranks)
    -> plait train (fully_shard over TP on a slice of the N-D root, torch's placements)
    -> the same model, init, data, optimizer and plan on torch's init_device_mesh +
       parallelize_module + fully_shard (benchmarks/train_torch.py), in the same run
    -> step time: the median over the timed steps (the first two, with warm-up, excluded) of
       each run's global tokens/s, as a time per step; the ratio plait/torch (below 1: plait's
       step is shorter); the step-1 losses side by side (equal when the comparison is like for like)
    -> bytes: each rank's plait.comm events of the last step, summed (the trainer's
       bytes_sent_by_axis), against plait.plan.traffic.bytes_per_step for that rank; the row
       gives the max over ranks of each and the number of ranks where the two differ

Wall time on a shared CPU machine measures the neighbours too: read the ratio, not the figures.
"""

from __future__ import annotations

import statistics

from benchmarks.bench_train import _config, _train_torch
from benchmarks.common import human_bytes, print_table, ratio
from plait.testing import run_distributed

LAYOUTS = [
    ("FSDP 2 x TP 2", 4, ["--parallel.dp_shard", "2", "--parallel.tp", "2"]),
    ("HSDP 2 x 2 x TP 2", 8, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--parallel.tp", "2"]),
]


def _train_counted(overrides: list[str]) -> dict:
    """plait train on this rank: median tokens/s, step-1 loss, and the last step's bytes this
    rank sent (measured) next to the formula's for this rank."""
    import torch.distributed as dist

    from plait.plan.traffic import bytes_per_step
    from plait.train import train
    from plait.train.layout import check

    config = _config(overrides)
    result = train(config)
    args, dims = check(config, dist.get_world_size())
    t = config.training
    predicted = bytes_per_step(args, dims, seq_len=t.seq_len, batch_size=t.batch_size,
                               global_rank=dist.get_rank(), ac_mode=config.activation_checkpoint.mode,
                               ac_every=config.activation_checkpoint.every)
    timed = result.records[2:] or result.records
    return {"tps": statistics.median(r.tokens_per_s for r in timed), "loss1": result.losses[0],
            "measured": result.bytes_sent_by_axis[-1], "predicted": predicted}


def run(quick: bool) -> None:
    steps = 6 if quick else 20
    rows = []
    for name, world, overrides in LAYOUTS:
        args = ["--training.steps", str(steps), *overrides]
        got = run_distributed(_train_counted, args, world_size=world, timeout=600)
        ref = run_distributed(_train_torch, args, world_size=world, timeout=600)[0]
        tokens = _config(args).training
        per_step = tokens.batch_size * tokens.seq_len
        plait_ms, torch_ms = 1e3 * per_step / got[0]["tps"], 1e3 * per_step / ref["tps"]
        measured = [sum(g["measured"].values()) for g in got]
        predicted = [sum(g["predicted"].values()) for g in got]
        differ = sum(g["measured"] != g["predicted"] for g in got)
        rows.append((name, world, f"{plait_ms:.1f}", f"{torch_ms:.1f}", ratio(plait_ms, torch_ms),
                     f"{got[0]['loss1']:.6f} / {ref['loss1']:.6f}", human_bytes(max(measured)),
                     human_bytes(max(predicted)), f"{differ} of {world}"))
    print_table(f"FSDP x TP and HSDP x TP: plait vs torch's composition, small config, {steps} steps",
                ("layout", "ranks", "plait ms/step", "torch ms/step", "plait/torch", "loss @1 plait / torch",
                 "bytes/rank/step (max)", "formula (max)", "ranks off formula"), rows,
                notes="torch: init_device_mesh + parallelize_module (plait's plan in torch's styles) + "
                "fully_shard per block and root, HSDP on mesh['dp_replicate', 'dp_shard'] "
                "(benchmarks/train_torch.py); median step time over steps 3..N; bytes from plait.comm's "
                "events of the last step against plait.plan.traffic.bytes_per_step, per axis, every rank")
