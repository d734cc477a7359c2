"""plait.checkpoint against torch.distributed.checkpoint, on the same FSDP state.

    model: 8 x Linear(d, d) (+bias), fully_shard per layer then the root (plait's
    fully_shard for plait, torch's for torch), Adam after one step: parameters + exp_avg +
    exp_avg_sq = 3 x 4 x 8(d^2 + d) bytes ~ 100 MB at d = 1024 (quick: d = 512, ~25 MB)
    -> save at world 4: both write the same state (plait: safetensors + crc32 of every
       chunk; torch: its default FileSystemWriter, sync_files on for both), alternating,
       slowest rank's wall time -> MiB/s of state and the median ratio
    -> async save at world 4: time the training thread is blocked (the call's return) and
       the peak extra host memory of the rank during the whole save (malloc's in-use bytes,
       all threads, sampled every ms, minus the level before) against one staged copy of
       what the rank writes
    -> load at world 2 (the other layout) from the world-4 checkpoints: MiB/s (plait
       verifies every checksum while loading; torch checks none)
    -> Hugging Face layout at world 4, the model's parameters only: plait's
       HuggingFaceStorageWriter (each rank writes its rows at their final offsets in the
       model-0000k-of-0000n files) against torch's (save_distributed + enable_consolidation,
       torch's way to the same final files from a sharded model), slowest rank's wall time
    -> Python calls on rank 0 for one save and one load of each (host_calls.count_calls):
       counted, so the same on a busy machine
Figures are wall time on a shared machine: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as torch_dcp
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import plait.checkpoint as dcp
from benchmarks.common import median, print_table
from benchmarks.host_calls import count_calls
from plait.device_mesh import init_device_mesh
from plait.fsdp import fully_shard
from plait.testing import run_distributed

LAYERS = 8


def _model(d: int, world: int, ours: bool):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(d, d) for _ in range(LAYERS)])
    if ours:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.device_mesh import init_device_mesh as torch_mesh

        mesh = torch_mesh("cpu", (world,))
        for layer in model:
            torch_fully_shard(layer, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, d)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _state(model, opt):
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _state_bytes(d: int) -> int:
    return 3 * 4 * LAYERS * (d * d + d)


def _slowest(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def _malloc_in_use() -> int:
    """Bytes malloc has handed out and not had back, all arenas, mmapped blocks included
    (RSS would not do: freed pages stay resident and the next save reuses them)."""
    m = _libc.mallinfo2()
    return m.uordblks + m.hblkhd


def _peak_extra(fn) -> int:
    """Peak of malloc's in-use bytes above the level before `fn`, sampled every ms from a
    thread (the background writes included)."""
    before, peak, done = _malloc_in_use(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _malloc_in_use() - before)
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return max(peak[0], _malloc_in_use() - before)


def save_world(root: str, d: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    ours, theirs = _state(*_model(d, 4, True)), _state(*_model(d, 4, False))
    p_path, t_path = os.path.join(root, "plait"), os.path.join(root, "torch")
    saves = {"plait": [], "torch": []}
    for k in range(rounds + 1):
        order = [("plait", lambda: dcp.save(ours, checkpoint_id=p_path)),
                 ("torch", lambda: torch_dcp.save(theirs, checkpoint_id=t_path))]
        for name, fn in order if k % 2 == 0 else order[::-1]:
            t = _slowest(fn)
            if k:  # the first round warms up both
                saves[name].append(t)
    blocked = {"plait": [], "torch": []}
    extra = {"plait": [], "torch": []}
    for k in range(rounds):
        def ours_async():
            t0 = time.perf_counter()
            fut = dcp.async_save(ours, checkpoint_id=p_path + "_async")
            blocked["plait"].append(time.perf_counter() - t0)
            fut.result()

        def theirs_async():
            t0 = time.perf_counter()
            fut = torch_dcp.async_save(theirs, checkpoint_id=t_path + "_async")
            blocked["torch"].append(time.perf_counter() - t0)
            fut.result()

        for name, fn in [("plait", ours_async), ("torch", theirs_async)][:: 1 if k % 2 == 0 else -1]:
            dist.barrier()
            extra[name].append(_peak_extra(fn))
        dist.barrier()
    # counted, not timed: Python calls on this rank's thread for one more save of each
    calls = {"plait": count_calls(lambda: dcp.save(ours, checkpoint_id=p_path)),
             "torch": count_calls(lambda: torch_dcp.save(theirs, checkpoint_id=t_path))}
    hf = {"plait": [], "torch": []}
    model_only = {"plait": ours["model"], "torch": theirs["model"]}
    for k in range(rounds + 1):
        order = [("plait", lambda: dcp.save(model_only["plait"],
                                            storage_writer=dcp.HuggingFaceStorageWriter(p_path + "_hf"))),
                 ("torch", lambda: torch_dcp.save(model_only["torch"], storage_writer=torch_dcp.HuggingFaceStorageWriter(
                     t_path + "_hf", save_distributed=True, enable_consolidation=True)))]
        for name, fn in order if k % 2 == 0 else order[::-1]:
            t = _slowest(fn)
            if k:
                hf[name].append(t)
    written = sum(sum(c.nbytes for c in t.chunks if c.file.startswith(f"__{rank}_"))
                  for t in dcp.FileSystemReader(p_path).read_metadata().tensors.values())
    dist.barrier()
    return {"save": saves, "blocked": blocked, "extra": extra, "staged": written, "hf": hf, "calls": calls}


def load_world(root: str, d: int, rounds: int) -> dict:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    ours_m, ours_o = _model(d, 2, True)
    theirs_m, theirs_o = _model(d, 2, False)
    _init_optim_state(ours_o)
    _init_optim_state(theirs_o)
    ours, theirs = _state(ours_m, ours_o), _state(theirs_m, theirs_o)
    loads = {"plait": [], "torch": []}
    for k in range(rounds + 1):
        order = [("plait", lambda: dcp.load(ours, checkpoint_id=os.path.join(root, "plait"))),
                 ("torch", lambda: torch_dcp.load(theirs, checkpoint_id=os.path.join(root, "torch")))]
        for name, fn in order if k % 2 == 0 else order[::-1]:
            t = _slowest(fn)
            if k:
                loads[name].append(t)
    calls = {"plait": count_calls(lambda: dcp.load(ours, checkpoint_id=os.path.join(root, "plait"))),
             "torch": count_calls(lambda: torch_dcp.load(theirs, checkpoint_id=os.path.join(root, "torch")))}
    # the two loaded the same values (the models started from the same seed and step)
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(ours_m.parameters(), theirs_m.parameters()))
    return {"load": loads, "same": same, "calls": calls}


def run(quick: bool) -> None:
    d, rounds = (512, 2) if quick else (1024, 5)
    mib = _state_bytes(d) / 2**20
    root = tempfile.mkdtemp(prefix="plait-bench-ckpt-")
    try:
        s = run_distributed(save_world, root, d, rounds, world_size=4, timeout=3600)
        r = run_distributed(load_world, root, d, rounds, world_size=2, timeout=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    s0 = s[0]
    rows = []
    for what, times in (("save, world 4", s0["save"]), ("load, world 4 -> 2", r["load"])):
        p, t = median(times["plait"]), median(times["torch"])
        rows.append([what, f"{mib / p:.0f}", f"{mib / t:.0f}", f"{(mib / p) / (mib / t):.2f}"])
    p, t = median(s0["hf"]["plait"]), median(s0["hf"]["torch"])
    rows.append(["HF layout save (params), world 4", f"{mib / 3 / p:.0f}", f"{mib / 3 / t:.0f}", f"{t / p:.2f}"])
    bp = max(median(x["blocked"]["plait"]) for x in s)
    bt = max(median(x["blocked"]["torch"]) for x in s)
    rows.append(["async_save blocked (ms, slowest rank)", f"{bp * 1e3:.0f}", f"{bt * 1e3:.0f}", f"{bp / bt:.2f}"])
    ep = max(max(x["extra"]["plait"]) for x in s)
    et = max(max(x["extra"]["torch"]) for x in s)
    staged = max(x["staged"] for x in s)
    rows.append(["async_save peak extra host MiB (max rank)", f"{ep / 2**20:.1f}", f"{et / 2**20:.1f}", f"{ep / et:.2f}"])
    for what, c in (("Python calls per save, rank 0 (counted)", s0["calls"]), ("Python calls per load, rank 0 (counted)", r["calls"])):
        rows.append([what, f"{c['plait']:,}", f"{c['torch']:,}", f"{c['plait'] / c['torch']:.2f}"])
    print_table(
        f"checkpoint: FSDP {LAYERS} x Linear({d}, {d}) + Adam, {mib:.0f} MiB of state, Gloo/CPU, "
        f"median of {rounds}",
        ["measure", "plait", "torch DCP", "plait/torch"], rows,
        notes=(f"MiB/s of state (plait checksums every chunk on save and verifies on load). One staged copy of "
               f"the largest rank's share: {staged / 2**20:.1f} MiB; plait's peak extra / that = {ep / staged:.2f}. "
               f"Loaded values equal torch's: {r['same']}."),
    )
