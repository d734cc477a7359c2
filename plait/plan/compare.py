"""`plait plan --compare RUN_DIR`: a finished run's measured figures against the plan's.

    RUN_DIR/metrics.jsonl -> the last "config" record (world size, the resolved config) and the
    step records after it -> the layout (plait.train.layout.check) -> the planner's prediction
    for rank 0 (the rank whose figures the log holds) -> one row per figure:
      bytes sent per step, per axis      the last step's count (exact: should be equal)
      step time                          the median of the steps after the first (and not
                                         the one metrics.live_bytes counted)
      memory per rank                    the peak live tensor bytes (max over ranks) of the first
                                         step, when the run had --metrics.live_bytes true
                                         (plait.train.live_bytes), against the fullest rank's
                                         prediction; and the log's peak RSS (CPU) or allocator
                                         peak (CUDA): a process figure, larger than the tensors
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from plait.plan.hardware import Hardware
from plait.plan.memory import memory_per_rank
from plait.plan.timing import step_time
from plait.plan.traffic import bytes_per_step


def read_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"no metrics.jsonl in {run_dir}: give the job.dir of a plait train run")
    config, steps = None, []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "config":
            config, steps = rec, []
        elif rec.get("kind") == "step":
            steps.append(rec)
    if config is None or not steps:
        raise ValueError(f"{path} holds no config record or no steps")
    return config, steps


def compare(run_dir: str | Path, hw: Hardware | None = None) -> tuple[list[tuple[str, str, str, str]], bool]:
    """(rows of (figure, predicted, measured, error), whether every byte count is equal)."""
    from plait.train.config import from_dict
    from plait.train.layout import check

    record, steps = read_run(run_dir)
    config = from_dict(record["config"])
    args, dims = check(config, record["world_size"])
    t, ac = config.training, config.activation_checkpoint
    kw = dict(seq_len=t.seq_len, batch_size=t.batch_size, ac_mode=ac.mode, ac_every=ac.every, global_rank=0)
    predicted = bytes_per_step(args, dims, **kw)
    measured = steps[-1].get("bytes_sent_by_axis") or {}
    rows, equal = [], predicted == measured
    for axis in sorted(set(predicted) | set(measured)):
        p, m = predicted.get(axis, 0), measured.get(axis, 0)
        rows.append((f"bytes/step {axis}", f"{p:,}", f"{m:,}", "equal" if p == m else f"{p - m:+,}"))
    import dataclasses

    from plait.plan.calibrate import cached
    from plait.plan.hardware import host_cores

    hw = hw or cached(record["world_size"]) or Hardware()
    hw = dataclasses.replace(hw, cores=host_cores())  # the run's ranks shared this host's cores
    time = step_time(args, dims, predicted, hw, **kw)
    timed = [s["step_time_s"] for s in steps[1:] if s.get("peak_live_bytes") is None]  # counted: slow
    timed = timed or [s["step_time_s"] for s in steps]
    median = statistics.median(timed)
    rows.append(("step time", f"{time.step_s * 1e3:.2f} ms", f"{median * 1e3:.2f} ms (median)",
                 f"{(time.step_s - median) / median:+.0%}"))
    mem = memory_per_rank(args, dims, **{k: v for k, v in kw.items()})
    live = [s["peak_live_bytes"] for s in steps if s.get("peak_live_bytes")]
    if live:  # the max over ranks, against the planner's fullest rank
        pred = max(memory_per_rank(args, dims, **{**kw, "global_rank": r}).total for r in range(dims.world_size))
        rows.append(("memory/rank", f"{pred / 2**20:.2f} MiB tensors", f"{max(live) / 2**20:.2f} MiB live tensors",
                     f"{(pred - max(live)) / max(live):+.1%}"))
    rss = max(s["peak_memory_mib"] for s in steps)
    rows.append(("process peak", f"{mem.total / 2**20:.1f} MiB tensors", f"{rss:.0f} MiB (RSS)", "n/a"))
    return rows, equal


def format_rows(rows: list[tuple[str, str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in [("figure", "predicted", "measured", "error"), *rows]) for i in range(4)]
    head = ("figure", "predicted", "measured", "error")
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "-" * (sum(widths) + 6)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)
