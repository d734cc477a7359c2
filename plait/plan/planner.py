"""Rank the layouts: every kept layout predicted on every rank, the worst rank's figures kept.

    config + N -> layouts.enumerate_layouts -> per layout, per global rank: traffic, memory,
    timing -> Prediction (max over ranks: the slowest and fullest rank decides) -> sorted:
    those within the memory limit first, then by predicted step time

The `plait train` command a prediction carries starts exactly that layout: the overrides the
user gave `plait plan` and the layout's `--parallel.*` values.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass

from plait.plan.hardware import Hardware
from plait.plan.layouts import Layout, Rejected, enumerate_layouts
from plait.plan.memory import Memory, memory_per_rank
from plait.plan.timing import StepTime, step_time
from plait.plan.traffic import bytes_per_step
from plait.train.config import JobConfig


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    memory: Memory  # of the rank with the most
    bytes_by_axis: dict[str, int]  # of the rank that sends the most
    time: StepTime  # of the slowest rank
    tokens_per_s: float
    fits: bool
    command: str

    @property
    def bytes_sent(self) -> int:
        return sum(self.bytes_by_axis.values())

    def record(self) -> dict:
        c = self.layout.choice
        return {"layout": {"dp_replicate": c.dp_replicate, "dp_shard": c.dp_shard, "cp": c.cp, "tp": c.tp, "pp": c.pp,
                           "pp_schedule": c.pp_schedule if c.pp > 1 else None,
                           "microbatches": self.layout.dims.microbatches,
                           "virtual_stages": self.layout.dims.virtual_stages,
                           "sequence_parallel": c.sequence_parallel, "activation_checkpoint": c.ac_mode},
                "describe": c.describe(), "memory_bytes_per_rank": self.memory.total,
                "memory_breakdown": self.memory.as_dict(), "fits": self.fits,
                "bytes_sent_per_rank": self.bytes_sent, "bytes_sent_by_axis": self.bytes_by_axis,
                "step_seconds": self.time.step_s, "compute_seconds": self.time.compute_s,
                "exposed_comm_seconds": self.time.exposed_s, "bubble": self.time.bubble,
                "tokens_per_s": self.tokens_per_s, "dominant": self.time.dominant(), "command": self.command}


def train_command(config_name: str, world: int, user_overrides: list[str], layout: Layout) -> str:
    head = ["plait", "train"] if world == 1 else ["plait", "run", "--standalone", "--nproc-per-node", str(world),
                                                  "-m", "plait.train"]
    return shlex.join([*head, "--config", config_name, *user_overrides, *layout.choice.overrides()])


def predict(layout: Layout, hw: Hardware, *, memory_limit: int | None, config_name: str = "tiny",
            user_overrides: list[str] = ()) -> Prediction:
    config, args, dims = layout.config, layout.args, layout.dims
    t, ac = config.training, config.activation_checkpoint
    kw = dict(seq_len=t.seq_len, batch_size=t.batch_size, ac_mode=ac.mode, ac_every=ac.every)
    worst_mem = worst_bytes = worst_time = None
    for rank in range(dims.world_size):
        mem = memory_per_rank(args, dims, global_rank=rank, **kw)
        traffic = bytes_per_step(args, dims, global_rank=rank, **kw)
        time = step_time(args, dims, traffic, hw, global_rank=rank, **kw)
        if worst_mem is None or mem.total > worst_mem.total:
            worst_mem = mem
        if worst_bytes is None or sum(traffic.values()) > sum(worst_bytes.values()):
            worst_bytes = traffic
        if worst_time is None or time.step_s > worst_time.step_s:
            worst_time = time
    fits = memory_limit is None or worst_mem.total <= memory_limit
    return Prediction(layout, worst_mem, worst_bytes, worst_time, t.batch_size * t.seq_len / worst_time.step_s,
                      fits, train_command(config_name, dims.world_size, list(user_overrides), layout))


def plan(config: JobConfig, world: int, *, hw: Hardware | None = None, memory_limit: int | None = None,
         config_name: str = "tiny", user_overrides: list[str] = ()) -> tuple[list[Prediction], list[Rejected]]:
    """Every layout of `world` ranks, best first, and the rejected ones with their reasons."""
    hw = hw or Hardware()
    kept, rejected = enumerate_layouts(config, world)
    preds = [predict(layout, hw, memory_limit=memory_limit, config_name=config_name,
                     user_overrides=user_overrides) for layout in kept]
    preds.sort(key=lambda p: (not p.fits, p.time.step_s, p.memory.total))
    return preds, rejected


def auto_layout(config: JobConfig, world: int) -> tuple[JobConfig, Prediction]:
    """`plait train --parallel.auto true`: the config with the best layout's values, and its
    prediction. Ranked with the default Hardware, never a machine's calibration cache, so every
    rank of a job, on any node, picks the same layout."""
    preds, rejected = plan(config, world)
    if not preds:
        reasons = "; ".join(sorted({r.reason for r in rejected})[:3])
        raise ValueError(f"--parallel.auto: no layout of {world} ranks fits this config ({reasons})")
    best = preds[0]
    chosen = best.layout.config
    parallel = dataclasses.replace(chosen.parallel, auto=False)
    return dataclasses.replace(chosen, parallel=parallel), best
