"""plait.tensor's DTensor against torch.distributed.tensor, in the same processes.

    redistribute   each transition at 1 MiB and 16 MiB (the global tensor, fp32): a sample
                   is the slowest rank's time for one call (result waited for), alternating
                   plait and torch; the table shows medians and plait / torch
    dispatch       a small op (a + b on two Shard(0) (64, 64) fp32 DTensors: no collective),
                   microseconds per op (best of 7 loops, rank 0 alone), and a plain add
    collectives    Linear -> GELU -> Linear, first colwise (weight and bias Shard(0)), second
                   rowwise (weight Shard(1), bias Replicate), input from_local(Replicate),
                   output redistributed to Replicate: collectives counted forward and backward

World sizes 2 and 4 on Gloo, one thread per rank (plait.testing's pool). torch's DTensor
needs torch's DeviceMesh; both meshes are built over the same default group.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn

from benchmarks.common import median, print_table, ratio, slowest_rank_time
from plait import comm
from plait import tensor as pt
from plait.debug import CommDebugMode
from plait.device_mesh import init_device_mesh
from plait.testing import run_distributed

# R -> P is left out: torch refuses it ("redistributing to Partial is for internal use only")
TRANSITIONS = [("S(0)", "R"), ("P", "R"), ("P", "S(0)"), ("S(0)", "S(1)"), ("R", "S(0)")]
SIZES = {"1 MiB": (512, 512), "16 MiB": (2048, 2048)}


def _placement(name: str, lib):
    return {"R": lib.Replicate(), "P": lib.Partial(), "S(0)": lib.Shard(0), "S(1)": lib.Shard(1)}[name]


def _wait(local: torch.Tensor) -> torch.Tensor:
    return local.wait() if hasattr(local, "wait") else local  # torch's AsyncCollectiveTensor


def _redistribute_rows(meshes, reps: int) -> list[tuple]:
    import torch.distributed.tensor as tt

    group = comm.world_group()
    rows = []
    for size_name, shape in SIZES.items():
        full = torch.randn(shape)
        for src, dst in TRANSITIONS:
            xs = {
                "plait": pt.distribute_tensor(full, meshes["plait"], [_placement(src, pt)]),
                "torch": tt.distribute_tensor(full, meshes["torch"], [_placement(src, tt)]),
            }
            targets = {"plait": [_placement(dst, pt)], "torch": [_placement(dst, tt)]}
            samples: dict[str, list[float]] = {"plait": [], "torch": []}
            for rep in range(reps + 1):
                for lib in ("plait", "torch"):
                    x, target, mesh = xs[lib], targets[lib], meshes[lib]
                    t = slowest_rank_time(lambda: _wait(x.redistribute(mesh, target).to_local()), group)  # noqa: B023
                    if rep:  # the first call builds plans and caches: not a sample
                        samples[lib].append(t)
            p, q = median(samples["plait"]) * 1e3, median(samples["torch"]) * 1e3
            rows.append((f"{src} -> {dst}", size_name, f"{p:.2f}", f"{q:.2f}", ratio(p, q)))
    return rows


def _dispatch_row(meshes, iters: int) -> tuple:
    """Rank 0 times while the others wait in a barrier, so the ranks' processes do not
    share the cores; plait, torch and plain adds alternate over seven rounds, and each
    keeps its best round (other processes on the machine only ever add time)."""
    import torch.distributed.tensor as tt

    full = torch.randn(64, 64)
    a = pt.distribute_tensor(full, meshes["plait"], [pt.Shard(0)])
    b = pt.distribute_tensor(full, meshes["plait"], [pt.Shard(0)])
    ta = tt.distribute_tensor(full, meshes["torch"], [tt.Shard(0)])
    tb = tt.distribute_tensor(full, meshes["torch"], [tt.Shard(0)])
    la, lb = a.to_local(), b.to_local()
    calls = {"plait": lambda: a + b, "torch": lambda: ta + tb, "plain": lambda: la + lb}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    if comm.get_rank(comm.world_group()) == 0:
        for fn in calls.values():
            for _ in range(200):
                fn()
        for _ in range(7):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                samples[name].append((time.perf_counter() - t0) / iters * 1e6)
    comm.barrier(group=comm.world_group())
    if not samples["plait"]:
        return ()
    p, q, plain = (min(samples[name]) for name in ("plait", "torch", "plain"))
    return f"{p:.1f}", f"{q:.1f}", ratio(p, q), f"{plain:.1f}"


def _mlp(lib, mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    layout = {"0.weight": lib.Shard(0), "0.bias": lib.Shard(0), "2.weight": lib.Shard(1),
              "2.bias": lib.Replicate()}
    for name, placement in layout.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = getattr(module, attr)
        setattr(module, attr, nn.Parameter(lib.distribute_tensor(param.detach(), mesh, [placement])))
    return model


def _count(mode_cls, counts_of, lib, mesh) -> tuple[str, str]:
    model = _mlp(lib, mesh)
    x = torch.randn(4, 16, 64, requires_grad=True)
    with mode_cls() as forward:
        out = model(lib.DTensor.from_local(x, mesh, [lib.Replicate()])).redistribute(mesh, [lib.Replicate()])
    local = _wait(out.to_local())
    with mode_cls() as backward:
        local.pow(2).sum().backward()
    return counts_of(forward), counts_of(backward)


def _plait_counts(mode) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(mode.get_comm_counts().items())) or "none"


def _torch_counts(mode) -> str:
    counts = {str(op).split(".")[-1].removesuffix("_"): n for op, n in mode.get_comm_counts().items()}
    return ", ".join(f"{n} {op}" for op, n in sorted(counts.items()) if n) or "none"


def _worker(quick: bool) -> dict:
    import torch.distributed.tensor as tt
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    warnings.filterwarnings("ignore")
    n = comm.get_world_size(comm.world_group())
    meshes = {"plait": init_device_mesh("cpu", (n,)), "torch": torch_mesh("cpu", (n,))}
    return {
        "redistribute": _redistribute_rows(meshes, reps=3 if quick else 15),
        "dispatch": _dispatch_row(meshes, iters=300 if quick else 2000),
        "counts": (_count(CommDebugMode, _plait_counts, pt, meshes["plait"]),
                   _count(TorchCommDebugMode, _torch_counts, tt, meshes["torch"])),
    }


def run(quick: bool) -> None:
    results = {n: run_distributed(_worker, quick, world_size=n, timeout=1800)[0] for n in (2, 4)}
    rows = [(n, *row) for n, r in results.items() for row in r["redistribute"]]
    print_table("DTensor redistribute: median ms per call (slowest rank)",
                ["ranks", "transition", "global size", "plait ms", "torch ms", "plait/torch"], rows,
                notes="Goal: plait/torch <= 1.0. R -> S(0) is a local chunk (copied, as torch does); "
                      "R -> P is not timed: torch refuses it.")
    rows = [(n, "a + b, Shard(0) (64, 64)", *r["dispatch"]) for n, r in results.items()]
    print_table("DTensor dispatch overhead: microseconds per small op",
                ["ranks", "op", "plait us", "torch us", "plait/torch", "plain tensor us"], rows,
                notes="Goal: plait/torch <= 1.0. torch 2.13 dispatches DTensor ops on a C++ fast path.")
    rows = []
    for n, r in results.items():
        (pf, pb), (tf, tb) = r["counts"]
        rows += [(n, "forward", pf, tf), (n, "backward", pb, tb)]
    print_table("Collectives in Linear -> GELU -> Linear (colwise, rowwise)",
                ["ranks", "pass", "plait", "torch"], rows,
                notes="Goal: the same as torch: one all-reduce forward, one backward.")


__all__ = ["run"]
