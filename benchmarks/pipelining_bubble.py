"""The bubble half of `benchmarks pipelining`: stages that sleep instead of computing, every
sleep logged, the measured bubble set against the simulator's.

    SleepStage: F sleeps 1 unit; backward 1 on the input path (I), 1 on the weight path (W)
    rows(names) per schedule, on every rank of the group:
        p2p latency (rank 0 <-> 1) and the stages' own time awake per pass (a plain loop)
        -> each step of plait's and torch's runtime: every rank's (start, end) of each sleep
        -> bubble = 1 - sum(sleep) / (p * window), the simulator's definition
        -> the runtimes' CPU per compute action beyond the stages' own (thread_time)
        -> simulate() with the latency as Costs.comm, then the per-action costs as Costs.host
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_pipelining import MICROBATCHES, SCHEDULES, _owned, _run_step, _schedules
from benchmarks.common import median
from plait import comm
from plait.pipelining import Costs, build_schedule, simulate

_SLEEPS: list[tuple[float, float]] = []  # this process's (start, end) of every sleep


def _sleep(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    _SLEEPS.append((start, time.perf_counter()))


class _SleepInBackward(torch.autograd.Function):
    """Identity forward (a copy: torch's I detaches stage outputs in place, which a view
    refuses); backward sleeps `seconds`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _sleep(ctx.seconds)
        return grad, None


class SleepStage(nn.Module):
    """F sleeps 1 unit; backward 1 on the input path (I) and 1 on the weight path (W)."""

    def __init__(self, unit: float, dim: int = 4) -> None:
        super().__init__()
        self.unit = unit
        self.w = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _sleep(self.unit)
        y = x * _SleepInBackward.apply(self.w, self.unit)  # W: mul's weight grad, then sleep
        return _SleepInBackward.apply(y, self.unit)  # I: sleep, then mul's input grad


def _bubble_of_step(schedule, stages: list[int], num_stages: int, x, y) -> tuple[float, float]:
    """Run one step; (its bubble from every rank's logged sleeps, this rank's CPU seconds)."""
    dist.barrier()
    _SLEEPS.clear()
    cpu = time.thread_time()
    _run_step(schedule, stages, num_stages, x, y)
    cpu = time.thread_time() - cpu
    starts, ends = zip(*_SLEEPS)
    local = torch.tensor(
        [min(starts), -max(ends), sum(e - s for s, e in _SLEEPS)], dtype=torch.float64
    )
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, local)
    stacked = torch.stack(everyone)  # (p, 3)
    window = -stacked[:, 1].min().item() - stacked[:, 0].min().item()
    return 1.0 - stacked[:, 2].sum().item() / (dist.get_world_size() * window), cpu


def _bare_stage(unit: float, n: int = 2 * MICROBATCHES) -> tuple[float, float]:
    """One SleepStage forward and backward in a plain loop (no pipeline), per iteration:
    (CPU seconds, wall seconds not sleeping: the stage's own autograd and tensor work)."""
    stage, x = SleepStage(unit), torch.randn(2, 4, requires_grad=True)
    _SLEEPS.clear()
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(n):
        stage(x).sum().backward()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    awake = wall - sum(e - s for s, e in _SLEEPS)
    _SLEEPS.clear()
    return cpu / n, awake / n


def _p2p_latency(reps: int = 30) -> float:
    """One-way plait.comm p2p time of a small tensor, rank 0 <-> 1 (median half round trip)."""
    group, rank = comm.world_group(), dist.get_rank()
    t, times = torch.zeros(2, 4), []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            comm.send(t, dst=1, group=group)
            comm.recv(t, src=1, group=group)
        elif rank == 1:
            comm.recv(t, src=0, group=group)
            comm.send(t, dst=0, group=group)
        times.append((time.perf_counter() - start) / 2)
    return median(times)


def rows(names: list[str], reps: int, unit: float) -> list[tuple]:
    """Per schedule: (name, stages, simulated, simulated with latency, latency, plait,
    torch, the stages' own µs, plait µs, torch µs, simulated with latency and the stages'
    µs, the same and plait's µs, the same and torch's). All µs are per compute action, mean over ranks:
    the stages' own is their wall time awake (autograd and tensor work between sleeps) in a
    plain loop; a runtime's is its CPU beyond the stages' own (the step's thread_time minus
    the same forwards and backwards in the loop). Both are rank time on the critical path
    that is not sleeping, which the simulator charges only as Costs.host."""
    p = dist.get_world_size()
    latency = _p2p_latency()
    bare_cpu, bare_awake = _bare_stage(unit)
    rows = []
    for name in names:
        v, _ = SCHEDULES[name]
        num_stages = p * v
        owned = _owned(name, p)
        modules = {s: SleepStage(unit) for s in owned}
        ours, theirs = _schedules(name, modules, num_stages, F.mse_loss)
        x = torch.randn(2 * MICROBATCHES, 4, requires_grad=True)
        y = torch.randn(2 * MICROBATCHES, 4)
        measured = {"plait": [], "torch": []}
        cpu = {"plait": [], "torch": []}
        for rep in range(reps + 1):
            for impl, schedule in (("plait", ours), ("torch", theirs)):
                b, c = _bubble_of_step(schedule, owned, num_stages, x, y)
                if rep:
                    measured[impl].append(b)
                    cpu[impl].append(c)
        plan = build_schedule(name, p, MICROBATCHES, stages_per_rank=v if v > 1 else None)
        actions = sum(1 for a in plan.actions[dist.get_rank()] if a.is_compute)
        passes = MICROBATCHES * len(owned) / actions  # stage passes (F and B) per compute action
        per_action = torch.tensor(
            [(median(cpu[k]) - bare_cpu * MICROBATCHES * len(owned)) / actions * 1e6 for k in cpu]
            + [bare_awake * passes * 1e6]
        )
        dist.all_reduce(per_action)
        per_action /= p
        *runtime_us, own_us = per_action.tolist()
        sim = simulate(plan, Costs(1.0, 2.0, 1.0)).bubble
        sim_latency = simulate(plan, Costs(1.0, 2.0, 1.0, comm=latency / unit)).bubble
        sim_host = [  # and the stages' own µs, then each runtime's too, on its rank before each compute
            simulate(plan, Costs(1.0, 2.0, 1.0, comm=latency / unit, host=us * 1e-6 / unit)).bubble
            for us in (own_us, *(own_us + max(0.0, r) for r in runtime_us))
        ]
        rows.append(
            (
                name,
                num_stages,
                sim,
                sim_latency,
                latency,
                median(measured["plait"]),
                median(measured["torch"]),
                own_us,
                *runtime_us,
                *sim_host,
            )
        )
    return rows
