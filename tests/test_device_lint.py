"""Every tensor plait allocates goes to the device its mesh, group or parameter is on: a lint
over plait/ flags each factory call without `device=` (torch.empty, zeros, ones, full, arange,
tensor, rand*, ...), each hard-coded CPU device ("cpu", torch.device("cpu"), .cpu()) and each
direct torch.cuda use. What is on the host on purpose (data loading, checkpoint staging and
file I/O, the cost model's calibration, decoding bytes received) is listed below per file,
with the count and the reason; a new one anywhere fails until it is given a device or a
reason here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "plait"
FACTORIES = frozenset({"empty", "zeros", "ones", "full", "arange", "tensor", "rand", "randn", "randint",
                       "randperm", "empty_strided", "linspace", "eye"})

# file (relative to plait/) -> (findings, why they are on the host or CUDA-specific)
ALLOWED: dict[str, tuple[int, str]] = {
    "testing/op_sweep.py": (2, "torch's op_db samples are CPU tensors; a seeded CPU generator draws the cotangent"),
    "checkpoint/async_saver.py": (1, "staging to pinned host memory for the writer thread"),
    "checkpoint/format_utils.py": (1, "offline checkpoint conversion loads into host memory"),
    "checkpoint/hf_reader.py": (1, "file reads land in host buffers"),
    "checkpoint/safetensors_io.py": (2, "file bytes are read and written from host memory"),
    "checkpoint/tools.py": (1, "offline tools work on host copies"),
    "checkpoint/state_dict/full.py": (4, "cpu_offload=True asks for host copies; bytes to host"),
    "checkpoint/state_dict/model.py": (1, "fallback device of a module without tensors"),
    "checkpoint/state_dict/optim.py": (2, "host placeholder lr / fallback device without tensors"),
    "checkpoint/group.py": (5, "no process group: one process, host; JSON decoded from host bytes"),
    "comm/device.py": (1, "the CPU device constant the host backends map to"),
    "comm/group.py": (3, "NCCL is CUDA's: picks and sets the CUDA device for it"),
    "data/rng.py": (4, "the CUDA generator's state is saved with the data state"),
    "data/sampler.py": (1, "indices are host data"),
    "data/text.py": (3, "token streams are produced on the host; the trainer moves batches"),
    "demo.py": (1, "the demo's host data"),
    "device_mesh.py": (4, "the mesh's rank table is host metadata; NCCL's CUDA device"),
    "ddp/comm_hooks/post_localSGD_hook.py": (2, "GPUs per node from CUDA's device count"),
    "fsdp/fully_shard.py": (2, "CPUOffloadPolicy keeps shards on the host; CUDA mesh check"),
    "fsdp/fsdp1/init.py": (2, "the mesh's rank table is host metadata"),
    "fsdp/fsdp1/optim_state.py": (1, "offload_to_cpu=True asks for host copies"),
    "fsdp/fsdp1/state_dict.py": (2, "offload_to_cpu=True asks for host copies"),
    "fsdp/fsdp1/wrapper.py": (1, "fallback device of a module without parameters"),
    "optim/zero_redundancy_optimizer.py": (1, "received bytes are decoded on the host"),
    "plan/calibrate.py": (2, "the cost model calibrates host matmuls and a block on one CPU thread"),
    "plan/probe.py": (4, "the probe measures Gloo, a CPU DTensor op and the CPU ranks' TP/CP steps here"),
    "tensor/ops/random_ops.py": (2, "the CUDA generator's state for a CUDA mesh"),
    "tensor/experimental/ring_plan.py": (2, "index plans are host metadata"),
    "train/data.py": (2, "batch indices are host data; the trainer moves batches"),
    "train/metrics.py": (1, "peak memory from CUDA when on CUDA"),
    "run/config.py": (1, "--nproc-per-node=gpu counts CUDA devices"),
    "ddp/comm_hooks/powerSGD_hook.py": (1, "torch's PowerSGD draws from a host generator, then moves"),
    "pipelining/meta.py": (1, "shape metadata encoded on the host, moved to the group's device"),
    "testing/_forkserver.py": (2, "the test pool runs on Gloo, on the host: its Dynamo warm-up compiles there"),
}


def _findings(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            kw = {k.arg for k in node.keywords}
            if (isinstance(f, ast.Attribute) and f.attr in FACTORIES and isinstance(f.value, ast.Name)
                    and f.value.id == "torch" and "device" not in kw):
                out.append((node.lineno, f"torch.{f.attr}(...) without device="))
            if isinstance(f, ast.Attribute) and f.attr == "cpu" and not node.args:
                out.append((node.lineno, ".cpu()"))
            for k in node.keywords:
                if k.arg == "device" and isinstance(k.value, ast.Constant) and k.value.value == "cpu":
                    out.append((node.lineno, 'device="cpu"'))
            if (isinstance(f, ast.Attribute) and f.attr == "device" and node.args
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == "cpu"):
                out.append((node.lineno, 'torch.device("cpu")'))
        if (isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name)
                and node.value.id == "torch"):
            out.append((node.lineno, "torch.cuda"))
    return sorted(set(out))


def _scan() -> dict[str, list[tuple[int, str]]]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        hits = _findings(ast.parse(path.read_text(), str(path)))
        if hits:
            found[rel] = hits
    return found


def test_every_allocation_names_its_device_or_a_reason():
    found = _scan()
    wrong = []
    for rel, hits in found.items():
        allowed = ALLOWED.get(rel, (0, ""))[0]
        if len(hits) != allowed:
            wrong.append(f"plait/{rel}: {len(hits)} host/CUDA-specific sites, {allowed} allowed: "
                         + "; ".join(f"line {n}: {what}" for n, what in hits))
    stale = [rel for rel, (n, _) in ALLOWED.items() if n and rel not in found]
    assert not wrong and not stale, (
        "give these tensors the device of their mesh, group or parameter (comm.group_device(group), "
        "param.device) or torch.accelerator, or list the file in ALLOWED with the reason:\n"
        + "\n".join(wrong) + (f"\nlisted but clean: {stale}" if stale else ""))


def test_the_lint_catches_a_hard_coded_cpu_allocation():
    tree = ast.parse("import torch\nx = torch.zeros(3)\ny = torch.ones(2, device=d)\nz = t.cpu()\n"
                     "w = torch.cuda.current_device()\nv = torch.empty(1, device='cpu')\n")
    assert [what for _, what in _findings(tree)] == [
        "torch.zeros(...) without device=", ".cpu()", "torch.cuda", 'device="cpu"']
