"""plait plan against the runs it predicts: the `small` config on 8 ranks, 12 layouts.

    plait plan's ranking (calibration cached for 8 processes, else defaults; this host's cores)
    -> 12 layouts: the predicted best 4 and the first of each kind below (TP, PP, CP, AC, FSDP x
       TP, HSDP, ...) -> each trained 10 steps by `plait run --nproc-per-node 8 -m plait.train`
       (--metrics.live_bytes true: step 2 counts live tensor bytes) -> plait plan --compare's
       figures: median step time of steps 3..10, peak live tensor bytes (max over ranks); and
       the job's CPU seconds a step (all ranks' threads) over the cores: the wall the step would
       take were the cores its only limit
    -> table: layout, predicted and measured step time and memory, errors; whether the
       predicted best is among the measured best two

torch's side: none (torch has no planner to compare with: its estimators are private).
Wall-clock on a shared host is noisy: the load average is printed beside the table.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import print_table

KINDS = [  # (name, predicate over a Prediction's layout choice)
    ("TP 2 + SP", lambda c: c.tp == 2 and c.pp == 1 and c.cp == 1 and c.sequence_parallel and c.ac_mode == "none"),
    ("TP 8", lambda c: c.tp == 8 and c.ac_mode == "none"),
    ("FSDP x TP", lambda c: c.dp_shard > 1 and c.tp > 1 and c.pp == 1 and c.ac_mode == "none"),
    ("PP 1F1B", lambda c: c.pp > 1 and c.pp_schedule == "1F1B" and c.ac_mode == "none"),
    ("PP GPipe", lambda c: c.pp > 1 and c.pp_schedule == "GPipe" and c.ac_mode == "none"),
    ("CP", lambda c: c.cp > 1 and c.tp == 1 and c.pp == 1 and c.ac_mode == "none"),
    ("AC full", lambda c: c.ac_mode == "full" and c.pp == 1 and c.tp == 1),
    ("HSDP", lambda c: c.dp_replicate > 1 and c.dp_shard > 1 and c.tp == 1 and c.pp == 1 and c.ac_mode == "none"),
]
STEPS = ["--training.steps", "10", "--metrics.val_batches", "0", "--metrics.progress", "false",
         "--checkpoint.enabled", "false", "--metrics.live_bytes", "true"]


def choose(preds, count: int = 12) -> list:
    chosen = list(preds[:4])
    for _, pred in KINDS:
        for p in preds:
            if pred(p.layout.choice) and p not in chosen:
                chosen.append(p)
                break
    for p in preds:
        if len(chosen) >= count:
            break
        if p not in chosen:
            chosen.append(p)
    return chosen[:count]


def _run(overrides: list[str], job_dir: str) -> bool:
    cmd = [sys.executable, "-m", "plait", "run", "--standalone", "--nproc-per-node", "8", "-m", "plait.train",
           "--config", "small", *STEPS, "--job.dir", job_dir, *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode:
        print(f"  failed ({done.returncode}): {' '.join(overrides)}\n{done.stderr[-2000:]}", flush=True)
    return done.returncode == 0


def run(quick: bool = False) -> None:
    import dataclasses

    from plait.plan.calibrate import cached
    from plait.plan.compare import compare, read_run
    from plait.plan.hardware import Hardware, host_cores
    from plait.plan.planner import plan
    from plait.train.config import load

    hw = dataclasses.replace(cached(8) or Hardware(), cores=host_cores())
    preds, _ = plan(load("small"), 8, hw=hw, config_name="small")
    chosen = choose(preds, 4 if quick else 12)
    rows, measured = [], []
    for p in chosen:
        job = tempfile.mkdtemp(prefix="plait-bench-plan-")
        print(f"  running {p.layout.choice.describe()} (load {os.getloadavg()[0]:.1f})", flush=True)
        if not _run(p.layout.choice.overrides(), job):
            continue
        figures = {r[0]: r for r in compare(job, hw)[0]}
        steps = read_run(job)[1][2:]  # as compare's timings: past the first and the counted step
        cpu_ms = statistics.median(s["step_cpu_s"] for s in steps) / hw.cores * 1e3 if hw.cores else float("nan")
        t_ms = float(figures["step time"][2].split()[0])
        mem = figures.get("memory/rank")
        live = float(mem[2].split()[0]) if mem else float("nan")
        pred_mem = p.memory.total / 2**20
        measured.append((t_ms, p))
        rows.append([p.layout.choice.describe(), f"{p.time.step_s * 1e3:.1f}", f"{t_ms:.1f}",
                     f"{(p.time.step_s * 1e3 - t_ms) / t_ms:+.0%}", f"{cpu_ms:.1f}", f"{pred_mem:.2f}", f"{live:.2f}",
                     f"{(pred_mem - live) / live:+.1%}"])
    best_two = [p for _, p in sorted(measured, key=lambda x: x[0])[:2]]
    verdict = "yes" if measured and chosen[0] in best_two else "no"
    print_table("plait plan vs plait train: small, 8 ranks",
                ["layout", "pred ms", "meas ms", "err", "cpu/cores ms", "pred MiB", "live MiB", "err"], rows,
                notes=f"hardware: {hw.source}, {hw.cores} cores; load average {os.getloadavg()}; predicted best "
                      f"{chosen[0].layout.choice.describe()} among the measured best two: {verdict} "
                      f"(measured best: {', '.join(p.layout.choice.describe() for p in best_two)})")
