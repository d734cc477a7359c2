"""What the planner knows of the machine: FLOP rate, host cost per op, collective costs per group
size, and the sharded models' measured factors, all at the process count they were measured at.

    defaults (no --calibrate): 5e10 FLOP/s per rank, 8 us per op, 70 us per DTensor op (plait's
      Python dispatch; measured on this 2-core host, loaded), Gloo 1e9 B/s and 50 us per call,
      overlap 0.5
    calibrate.py -> Hardware(nproc=N, collectives, p2p, tp_factors, tp_ddp_factors, tp_fsdp_factors,
      cp_factors, fsdp_factors, contention) -> timing.step_time; a figure measured at another process count
      than the job's is not used (in_situ)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TP_WRAPPERS = ("", "replicate", "fully_shard")  # TP alone; under DDP (R x T); under FSDP (S x T, HSDP x T)


@dataclass(frozen=True)
class Hardware:
    flop_rate: float = 5e10  # FLOP/s per rank
    bandwidth: float = 1e9  # bytes/s a rank sends on a collective
    latency: float = 50e-6  # seconds per collective call on 2 ranks
    overlap: float = 0.5  # fraction of compute that can hide data-parallel communication
    op_s: float = 8e-6  # host seconds per dispatched aten op
    dtensor_op_s: float = 70e-6  # host seconds per op on a DTensor
    cores: int = 0  # cores the ranks share (0: one each, no oversubscription)
    nproc: int = 0  # the process count `collectives` was measured at (0: none measured)
    collectives: tuple[tuple[int, float, float], ...] = ()  # (group size, s per call, bytes/s per rank) at nproc
    p2p: float = 0.0  # s a stage-to-stage send or receive adds at nproc (probe.py; 0: not measured)
    ac_factor: float = 0.0  # a checkpointed block's time over a plain one's (0: not measured; FLOPs 8/6, ops AC_OPS)
    tp_factors: tuple[tuple[int, bool, float], ...] = ()  # (tp, sequence parallel, factor) at nproc (probe.py)
    tp_ddp_factors: tuple[tuple[int, bool, float], ...] = ()  # the same under replicate over nproc / tp (R x T)
    tp_fsdp_factors: tuple[tuple[int, bool, float], ...] = ()  # the same under fully_shard over nproc / tp
    cp_factors: tuple[tuple[int, float], ...] = ()  # (cp, factor) at nproc (probe.py)
    fsdp_factors: tuple[tuple[int, float], ...] = ()  # (dp_shard, factor): the plain model under fully_shard
    contention: float = 1.0  # CPU work's cost among nproc ranks here over alone (probe.py; 1: not measured)
    source: str = "defaults"

    def as_dict(self) -> dict:
        return asdict(self)

    def in_situ(self, world: int) -> bool:
        """Whether the collective costs were measured among `world` processes on this host."""
        return bool(self.collectives) and self.nproc == world

    def collective(self, group: int, world: int) -> tuple[float, float]:
        """(seconds per call, bytes/s per rank) of a collective over `group` ranks of a `world`-rank job:
        the probe's figure at that process count (its group size, else the next larger one measured);
        otherwise the 2-rank latency times Gloo's g - 1 ring steps, and the 2-rank bandwidth."""
        if self.in_situ(world):
            for g, call, bw in self.collectives:
                if g >= group:
                    return call, bw
            return self.collectives[-1][1:]
        return self.latency * max(1, group - 1), self.bandwidth

    def transfer(self, world: int) -> tuple[float, float]:
        """(seconds per call, bytes/s) of a pipeline's send or receive in a `world`-rank job: the
        probe's p2p figure at that process count, else a 2-rank collective's."""
        call, bandwidth = self.collective(2, world)
        return (self.p2p if self.p2p and self.in_situ(world) else call), bandwidth

    def tp_factor(self, tp: int, sequence_parallel: bool, world: int, *, wrapper: str = "") -> float:
        """A TP rank's wall per step over the plain model's CPU at its tokens, measured among
        `world` processes here: TP alone, or under the data-parallel `wrapper` ("replicate",
        "fully_shard") over the other world / tp ranks (0: not measured)."""
        if not self.in_situ(world):
            return 0.0
        table = dict(zip(TP_WRAPPERS, (self.tp_factors, self.tp_ddp_factors, self.tp_fsdp_factors)))[wrapper]
        return next((f for g, sp, f in table if g == tp and sp == sequence_parallel), 0.0)

    def cp_factor(self, cp: int, world: int) -> float:
        """A CP rank's wall per step over the plain model's at as many tokens, measured among
        `world` processes here (0: not measured)."""
        return self._at_degree(self.cp_factors, cp, world)

    def fsdp_factor(self, shard: int, world: int) -> float:
        """An FSDP rank's wall per step (fully_shard over groups of `shard`) over the plain
        model's at its tokens, measured among `world` processes here (0: not measured)."""
        return self._at_degree(self.fsdp_factors, shard, world)

    def _at_degree(self, table: tuple[tuple[int, float], ...], degree: int, world: int) -> float:
        return next((f for d, f in table if d == degree), 0.0) if self.in_situ(world) else 0.0


def host_cores() -> int:
    """Cores this process may run on (the ranks of a one-host job share them)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1
