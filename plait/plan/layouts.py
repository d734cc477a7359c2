"""Every layout of N ranks, each kept or rejected by plait.train's own rules (torch-free).

    JobConfig + N -> candidates: ordered factorizations N = pp * dp_replicate * dp_shard * cp * tp,
    x (pp > 1) each schedule with its stages per rank (1, or 2 for the multi-stage ones) and
    microbatches in {stages, 2 * stages}, x sequence parallel on/off (tp > 1), x AC none|full|every
    -> plait.train.layout.check(config with those values, N): ParallelDims, or the ValueError
    naming the numbers ("model n_heads(6) is not divisible by tp(4)") -> Layout | Rejected

No divisibility rule lives here: a layout is what `plait train` itself would start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from plait.train.config import JobConfig
from plait.train.layout import MULTI_STAGE, SINGLE_STAGE, V_SCHEDULES, check

AC_MODES = ("none", "full", "every")


@dataclass(frozen=True)
class Choice:
    """The `--parallel.*` / `--activation_checkpoint.mode` values of one candidate."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    pp_schedule: str
    microbatches: int
    virtual_stages: int
    sequence_parallel: bool
    ac_mode: str
    cp: int = 1

    def overrides(self) -> list[str]:
        """The command-line overrides that select it."""
        out = ["--parallel.dp_replicate", str(self.dp_replicate), "--parallel.dp_shard", str(self.dp_shard),
               "--parallel.cp", str(self.cp), "--parallel.tp", str(self.tp), "--parallel.pp", str(self.pp)]
        if self.pp > 1:
            out += ["--parallel.pp_schedule", self.pp_schedule, "--parallel.microbatches", str(self.microbatches),
                    "--parallel.virtual_stages", str(self.virtual_stages)]
        if self.tp > 1:
            out += ["--parallel.sequence_parallel", "true" if self.sequence_parallel else "false"]
        return out + ["--activation_checkpoint.mode", self.ac_mode]

    def describe(self) -> str:
        dims = (("R", self.dp_replicate), ("S", self.dp_shard), ("C", self.cp), ("T", self.tp), ("P", self.pp))
        parts = [f"{k}{v}" for k, v in dims if v > 1] or ["1 rank"]
        if self.pp > 1:
            parts.append(f"{self.pp_schedule}/m{self.microbatches}" + (f"/v{self.virtual_stages}"
                                                                        if self.virtual_stages > 1 else ""))
        if self.tp > 1 and not self.sequence_parallel:
            parts.append("noSP")
        if self.ac_mode != "none":
            parts.append(f"AC:{self.ac_mode}")
        return " ".join(parts)

    def apply(self, config: JobConfig) -> JobConfig:
        parallel = dataclasses.replace(config.parallel, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                                       cp=self.cp, tp=self.tp, pp=self.pp, pp_schedule=self.pp_schedule,
                                       microbatches=self.microbatches, virtual_stages=self.virtual_stages,
                                       sequence_parallel=self.sequence_parallel, pp_layers=[])
        ac = dataclasses.replace(config.activation_checkpoint, mode=self.ac_mode)
        return dataclasses.replace(config, parallel=parallel, activation_checkpoint=ac)


@dataclass(frozen=True)
class Layout:
    choice: Choice
    config: JobConfig
    args: object  # ModelArgs
    dims: object  # plait.train.layout.ParallelDims


@dataclass(frozen=True)
class Rejected:
    choice: Choice
    reason: str


def factorizations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Ordered tuples of `parts` positive ints whose product is n."""
    if parts == 1:
        yield (n,)
        return
    for first in range(1, n + 1):
        if n % first == 0:
            for rest in factorizations(n // first, parts - 1):
                yield (first, *rest)


def choices(config: JobConfig, world: int, *, ac_modes: tuple[str, ...] = AC_MODES) -> Iterator[Choice]:
    for pp, dp_replicate, dp_shard, cp, tp in factorizations(world, 5):
        if pp == 1:
            schedules = [(config.parallel.pp_schedule, 0, 1)]
        else:
            schedules = []
            for name in (*SINGLE_STAGE, *MULTI_STAGE):
                v = 1 if name in SINGLE_STAGE else 2
                schedules += [(name, k * pp * v, v) for k in (1, 2)]
        for sp in ((True, False) if tp > 1 else (config.parallel.sequence_parallel,)):
            for name, m, v in schedules:
                for ac in ac_modes:
                    yield Choice(dp_replicate, dp_shard, tp, pp, name, m, v, sp, ac, cp)


def enumerate_layouts(config: JobConfig, world: int, *,
                      ac_modes: tuple[str, ...] = AC_MODES) -> tuple[list[Layout], list[Rejected]]:
    """Every candidate of `world` ranks: those plait train accepts, and the others with why."""
    if world < 1:
        raise ValueError(f"--nproc must be >= 1, got {world}")
    kept, rejected = [], []
    for choice in choices(config, world, ac_modes=ac_modes):
        if choice.ac_mode == "every" and config.activation_checkpoint.every < 1:
            rejected.append(Rejected(choice, f"activation_checkpoint.every({config.activation_checkpoint.every}) < 1"))
            continue
        candidate = choice.apply(config)
        try:
            args, dims = check(candidate, world)
        except ValueError as e:
            rejected.append(Rejected(choice, str(e)))
            continue
        kept.append(Layout(choice, candidate, args, dims))
    return kept, rejected


__all__ = ["AC_MODES", "Choice", "Layout", "Rejected", "V_SCHEDULES", "choices", "enumerate_layouts",
           "factorizations"]
