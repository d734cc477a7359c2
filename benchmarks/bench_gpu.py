"""plait vs torch on the GPUs present (NCCL): DDP, FSDP2 and TP step time, side by side.

    python -m benchmarks gpu [--quick]      (benchmarks/gpu.sh runs it after tests/gpu)

Each row launches `plait run --nproc-per-node W` (W = min(GPUs, 4)) on this file: every rank
builds the same 8-layer MLP (dim 2048, batch 16 x 2048 per rank; bf16 off, TF32 off), wraps
it once with plait and once with torch's own (torch.nn.parallel.DistributedDataParallel,
torch.distributed.fsdp.fully_shard, torch.distributed.tensor.parallel.parallelize_module),
and times forward + backward + SGD step: warm-up, then rounds alternating which goes first,
each step fenced by torch.accelerator.synchronize(); the slowest rank's median per step. Without
CUDA it prints that and returns (a benchmark never fails on the machine it finds).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DIM, LAYERS, TOKENS = 2048, 8, 16 * 2048


def run(quick: bool) -> None:
    from benchmarks.common import print_table, ratio

    if not torch.cuda.is_available():
        print("\n### GPU: plait vs torch\n\nno CUDA device on this machine: nothing measured\n", flush=True)
        return
    world = min(torch.cuda.device_count(), 4)
    rows = []
    for name in ("ddp", "fsdp", "tp"):
        out = Path(tempfile.mkdtemp(prefix="plait-bench-gpu-")) / "out.json"
        cmd = [sys.executable, "-m", "plait", "run", "--nproc-per-node", str(world), str(Path(__file__)),
               name, str(out), "quick" if quick else "full"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
        if proc.returncode != 0:
            rows.append((name, world, "failed", "", "", proc.stderr.strip().splitlines()[-1:]))
            continue
        got = json.loads(out.read_text())
        rows.append((name, world, f"{got['plait_ms']:.2f}", f"{got['torch_ms']:.2f}",
                     ratio(got["plait_ms"], got["torch_ms"]), ""))
    print_table(f"GPU step time, plait vs torch ({torch.cuda.get_device_name()} x {world})",
                ["strategy", "GPUs", "plait ms", "torch ms", "plait/torch", "note"], rows,
                notes=f"MLP {LAYERS} x {DIM}, {TOKENS // 2048} x 2048 rows per rank, fp32; median of "
                      "alternating rounds, slowest rank")


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(DIM, DIM), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(device)


def _wrap(name: str, impl: str, device: torch.device) -> torch.nn.Module:
    world = int(os.environ["WORLD_SIZE"])
    model = _model(device)
    if impl == "plait":
        from plait.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (world,))
        if name == "ddp":
            from plait.ddp import DistributedDataParallel

            return DistributedDataParallel(model, process_group=mesh.get_group(0))
        if name == "fsdp":
            from plait.fsdp import fully_shard

            for layer in model[::2]:
                fully_shard(layer, mesh=mesh)
            return fully_shard(model, mesh=mesh)
        from plait.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {str(i): ColwiseParallel() if i % 4 == 0 else RowwiseParallel() for i in range(0, 2 * LAYERS, 2)}
        return parallelize_module(model, mesh, plan)
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    mesh = torch_mesh("cuda", (world,))
    if name == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index])
    if name == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model[::2]:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {str(i): ColwiseParallel() if i % 4 == 0 else RowwiseParallel() for i in range(0, 2 * LAYERS, 2)}
    return parallelize_module(model, mesh, plan)


def _worker(name: str, out: str, quick: bool) -> None:
    import torch.distributed as dist

    from plait import comm

    torch.backends.cuda.matmul.allow_tf32 = False
    comm.init_process_group("nccl")
    device = torch.device("cuda", torch.cuda.current_device())
    rows = TOKENS if name != "tp" else TOKENS // 4  # TP: every rank runs the same (smaller) batch
    x = torch.randn(rows // 2048, 2048, DIM, device=device)
    steps = {}
    for impl in ("plait", "torch"):
        model = _wrap(name, impl, device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt) -> None:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

        steps[impl] = step
    warmup, rounds = (2, 5) if quick else (3, 15)
    for _ in range(warmup):
        steps["plait"]()
        steps["torch"]()
    times: dict[str, list[float]] = {"plait": [], "torch": []}
    for k in range(rounds):
        for impl in ("plait", "torch") if k % 2 == 0 else ("torch", "plait"):
            torch.accelerator.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            steps[impl]()
            torch.accelerator.synchronize()
            times[impl].append(time.perf_counter() - t0)
    med = torch.tensor([statistics.median(times["plait"]), statistics.median(times["torch"])], device=device)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"plait_ms": 1e3 * med[0].item(), "torch_ms": 1e3 * med[1].item()}))
    comm.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _worker(sys.argv[1], sys.argv[2], sys.argv[3] == "quick")
