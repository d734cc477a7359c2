"""torch's op_db on plait's DTensor and on torch's, in the same processes (plait.testing.op_sweep).

    counts   per library: OpInfos that pass (every sample, every layout, forward and the
             gradients of every float input, against one device), fail, or have no DTensor
             input (n/a); for plait also the OpInfos that ran without one call through the
             replicate-everything fallback (a rule for every op they reached), and the
             expected failures listed in plait.testing.op_db_xfail (with their reasons)
    host     microseconds per forward call of each OpInfo's first sample, all inputs
             Replicate (nothing to move: the dispatch itself), median of 5 calls per op;
             the table gives the median over the ops both libraries pass, and plait / torch

World size 2 on Gloo, one thread per rank (the worst case for uneven pieces is world 3:
`--quick` runs world 3 on the CI sample instead). torch's sweep compares shapes only for
random ops: its draws are offset-based, not the single-process stream plait reproduces.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

from benchmarks.common import print_table
from plait.testing import run_distributed
from plait.testing.op_db_xfail import CI_SAMPLE, XFAIL
from plait.testing.op_sweep import FAIL, NA, PASS, full_name, op_infos, sweep_op


def _torch_api() -> SimpleNamespace:
    import torch.distributed.tensor as tt

    return SimpleNamespace(DTensor=tt.DTensor, Replicate=tt.Replicate, Shard=tt.Shard,
                           distribute_tensor=tt.distribute_tensor, same_random_values=False)


def _rank(names: list[str], world: int, lib: str) -> list:
    import torch.distributed.device_mesh as tdm

    from plait.device_mesh import init_device_mesh
    from plait.tensor.debug import fallback_counts, set_fallback_policy
    from plait.testing.op_sweep import plait_api

    if lib == "plait":
        set_fallback_policy("silent")
        mesh, api, counts = init_device_mesh("cpu", (world,)), plait_api(), fallback_counts
    else:
        mesh, api, counts = tdm.init_device_mesh("cpu", (world,)), _torch_api(), None
    rows = []
    for info in op_infos(names):
        r = sweep_op(info, mesh, api, fallback_counts=counts)
        rows.append((r.name, r.status, r.fallback, r.detail[:200], _host_us(info, mesh, api)))
    return rows


def _host_us(info, mesh, api) -> float | None:
    """Median microseconds of 5 forward calls on the first sample, inputs Replicate."""
    import torch
    from torch.utils import _pytree as pytree

    try:
        sample = next(iter(info.sample_inputs("cpu", torch.float32)))
        flat, tree = pytree.tree_flatten(([sample.input, *sample.args], dict(sample.kwargs)))
        if not any(isinstance(x, torch.Tensor) for x in flat):
            return None
        flat = [api.distribute_tensor(x, mesh, [api.Replicate()]) if isinstance(x, torch.Tensor) else x
                for x in flat]
        args, kwargs = pytree.tree_unflatten(flat, tree)
        info.op(*args, **kwargs)  # plan, caches
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            info.op(*args, **kwargs)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    except Exception:  # noqa: BLE001 - an op that fails here is counted by the sweep
        return None


def _chunk(names: list[str], world: int, lib: str) -> list:
    """The chunk's rows; where the chunk's call fails (ranks that part ways in a collective
    end it), each op again in a call of its own, and an op that fails alone is a "fail" row."""
    from plait.testing import shutdown

    try:
        return run_distributed(_rank, names, world, lib, world_size=world, timeout=180)[0]
    except Exception:  # noqa: BLE001 - isolated below
        shutdown()
    rows = []
    for name in names:
        try:
            rows += run_distributed(_rank, [name], world, lib, world_size=world, timeout=45)[0]
        except Exception as e:  # noqa: BLE001 - counted as a failure, with its first line
            shutdown()
            rows.append((name, FAIL, 0, f"the ranks parted ways: {str(e).splitlines()[0]}", None))
    return rows


def run(quick: bool) -> None:
    names = CI_SAMPLE if quick else [full_name(o) for o in op_infos()]
    world = 3 if quick else 2
    results = {}
    for lib in ("plait", "torch"):
        rows: list = []
        for i in range(0, len(names), 40):  # a chunk per call: a hung op costs its chunk only
            rows += _chunk(names[i:i + 40], world, lib)
        results[lib] = {r[0]: r for r in rows}
    plait, torch_ = results["plait"], results["torch"]
    count = {lib: {s: sum(1 for r in res.values() if r[1] == s) for s in (PASS, FAIL, NA)}
             for lib, res in results.items()}
    ruled = sum(1 for r in plait.values() if r[1] == PASS and r[2] == 0)
    expected = sum(1 for n in names if n in XFAIL)
    print_table(f"op_db on DTensor, world {world}: {len(names)} OpInfos",
                ["library", "pass", "fail", "n/a", "pass with no fallback call", "listed xfail"],
                [["plait", count["plait"][PASS], count["plait"][FAIL], count["plait"][NA], ruled, expected],
                 ["torch", count["torch"][PASS], count["torch"][FAIL], count["torch"][NA], "", ""]],
                notes="pass = every sample and layout, outputs and input gradients within 1e-4 of one device")
    both = [n for n in names if plait[n][1] == PASS and torch_[n][1] == PASS and plait[n][4] and torch_[n][4]]
    ratios = [plait[n][4] / torch_[n][4] for n in both]
    if ratios:
        print_table("host time per op, inputs Replicate (us, median over ops passing on both)",
                    ["ops", "plait", "torch", "plait / torch (median of per-op ratios)"],
                    [[len(both), f"{statistics.median(plait[n][4] for n in both):.0f}",
                      f"{statistics.median(torch_[n][4] for n in both):.0f}", f"{statistics.median(ratios):.2f}"]])
    unexpected = sorted(n for n in names if plait[n][1] == FAIL and n not in XFAIL)
    fixed = sorted(n for n in names if plait[n][1] == PASS and n in XFAIL)
    for title, group in (("plait fails, not listed", unexpected), ("plait passes, still listed", fixed)):
        if group:
            print(f"{title}: " + "; ".join(f"{n} ({plait[n][3]})" for n in group))
