"""What plait.debug costs, and how fast it reports a hang.

    DDP step: benchmarks.models' GPT (4 layers, d_model 256, vocab 1024, seq 128), plait's
      DistributedDataParallel, batch 8 per rank, AdamW, 2 ranks (Gloo, one thread each);
      settings alternate step by step — flight recorder off / on (the default) / with
      PLAIT_TRACE_STACKS=1 / PLAIT_DISTRIBUTED_DEBUG=DETAIL (log lines to a file) — and a
      sample is the slowest rank's step; the table shows medians and the ratio to "off".
      Real rank processes (env://, TCPStore), as in a job, not the test pool
    per op: the same settings around a 4 KiB all-reduce, microseconds per op; and the door's
      own bookkeeping per op with no transport: an all-reduce on a group of one, and a p2p
      send's event and handle (plait.comm.p2p's _begin and a completed Handle, what the
      pipeline runtime pays per transfer besides Gloo)
    hang: 2 real rank processes, rank 1 sleeps past PLAIT_COLLECTIVE_TIMEOUT before an
      all-reduce; seconds from rank 0 entering it to the report (dump written) and to its
      exit, against the timeout (goal: timeout + at most 2 s)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import median, print_table, slowest_rank_time
from benchmarks.models import GPT, GPTConfig, lm_loss, random_tokens
from plait import comm, debug
from plait.comm import p2p
from plait.comm.group import group_info
from plait.comm.work import Handle
from plait.ddp import DistributedDataParallel

WORLD = 2
BATCH_PER_RANK = 8
ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name -> plait.debug.configure(...) arguments
    "recorder off": dict(level="OFF", buffer_size=0, stacks=False),
    "recorder on (default)": dict(level="OFF", buffer_size=2000, stacks=False),
    "recorder + TRACE_STACKS": dict(level="OFF", buffer_size=2000, stacks=True),
    "DETAIL": dict(level="DETAIL", buffer_size=2000, stacks=False),
}


def _nothing() -> None:
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(quick: bool, log_path: str) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)
    logger = logging.getLogger("plait.debug")
    handler = logging.FileHandler(log_path)  # DETAIL formats and writes every line, off the console
    logger.addHandler(handler)
    group = comm.world_group()
    rank = comm.get_rank(group)
    cfg = GPTConfig.small()
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = random_tokens(cfg, BATCH_PER_RANK * WORLD, seed=0)[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]

    def step() -> None:
        lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    small = torch.ones(1024)  # 4 KiB
    ops_per_sample = 50 if quick else 200
    solo = comm.new_group([rank])  # a group of one: the door and its listeners, no transport
    solo_ops = 20 * ops_per_sample

    def ops() -> None:
        for _ in range(ops_per_sample):
            comm.all_reduce(small, group=group)

    def local_ops() -> float:
        t0 = time.perf_counter()
        for _ in range(solo_ops):
            comm.all_reduce(small, group=solo)
        return (time.perf_counter() - t0) / solo_ops

    solo_info = group_info(solo)  # its p2p sequence numbers are nobody else's

    def p2p_door() -> float:
        t0 = time.perf_counter()
        for _ in range(solo_ops):
            Handle(None, _nothing, p2p._begin("send", small, 0, solo_info, True)).wait()
        return (time.perf_counter() - t0) / solo_ops

    rounds = 6 if quick else 20
    steps: dict[str, list[float]] = {name: [] for name in SETTINGS}
    per_op: dict[str, list[float]] = {name: [] for name in SETTINGS}
    door: dict[str, list[float]] = {name: [] for name in SETTINGS}
    door_p2p: dict[str, list[float]] = {name: [] for name in SETTINGS}
    previous = debug.current_config()
    try:
        for _ in range(2):
            step()  # warm up: buckets rebuilt, allocator settled
        for k in range(rounds):
            order = list(SETTINGS) if k % 2 == 0 else list(SETTINGS)[::-1]  # nobody always goes first
            for name in order:
                debug.configure(**SETTINGS[name])
                steps[name].append(slowest_rank_time(step, group))
                per_op[name].append(slowest_rank_time(ops, group) / ops_per_sample)
                door[name].append(local_ops())
                door_p2p[name].append(p2p_door())
    finally:
        from plait.debug import session

        session.apply(previous)
        logger.removeHandler(handler)
        handler.close()
    return {"steps": {n: median(v) for n, v in steps.items()}, "per_op": {n: median(v) for n, v in per_op.items()},
            "door": {n: median(v) for n, v in door.items()},
            "door_p2p": {n: median(v) for n, v in door_p2p.items()}, "rounds": rounds, "ops": ops_per_sample}


HANG_SCRIPT = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    from plait import comm
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    g = comm.world_group()
    comm.all_reduce(torch.ones(4), group=g)
    if rank == 1:
        time.sleep(float(os.environ["SLEEP_S"]))
    comm.all_reduce(torch.ones(4), group=g)  # rank 0 hangs here
""")


def _hang(timeout_s: float, env: dict[str, str]) -> dict:
    """Seconds from rank 0 entering the stuck all-reduce to its report and to its exit."""
    with tempfile.TemporaryDirectory() as tmp:
        script, trace = Path(tmp) / "hang.py", Path(tmp) / "trace"
        script.write_text(HANG_SCRIPT)
        port = free_port()
        procs = []
        for rank in range(WORLD):
            full = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PLAIT_TRACE_DIR": str(trace),
                    "PLAIT_COLLECTIVE_TIMEOUT": str(timeout_s), "SLEEP_S": str(timeout_s + 10), **env}
            procs.append(subprocess.Popen([sys.executable, str(script)], env=full, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        exited_ns = None
        deadline = time.monotonic() + timeout_s + 120
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if exited_ns is None and procs[0].poll() is not None:
                exited_ns = time.time_ns()
            time.sleep(0.005)
        if exited_ns is None and procs[0].poll() is not None:
            exited_ns = time.time_ns()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        dump = json.loads((trace / "rank0.json").read_text())
    entered = [e for e in dump["entries"] if e["state"] != "completed"][-1]["time_scheduled_ns"]
    return {"report": (dump["dump_time_ns"] - entered) / 1e9, "exit": (exited_ns - entered) / 1e9,
            "codes": [p.returncode for p in procs]}


def _worker() -> None:
    """One rank of the overhead measurement (started by `_overheads` with env:// variables)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = _measure(os.environ["BENCH_QUICK"] == "1", os.environ["BENCH_LOG"])
    if dist.get_rank() == 0:
        Path(os.environ["BENCH_OUT"]).write_text(json.dumps(result))
    dist.destroy_process_group()


def _overheads(quick: bool) -> dict:
    """Run `_measure` on real rank processes: their default store is a TCPStore, as in a
    job (the test pool's FileStore would make DETAIL's store round trips look slower)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        port = free_port()
        procs = [subprocess.Popen(
            [sys.executable, "-c", "from benchmarks.bench_debug import _worker; _worker()"], cwd=ROOT,
            env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "BENCH_QUICK": "1" if quick else "0",
                 "BENCH_LOG": str(Path(tmp) / f"detail{rank}.log"), "BENCH_OUT": str(out),
                 "PLAIT_TRACE_DIR": str(Path(tmp) / "trace")})
            for rank in range(WORLD)]
        codes = [p.wait(timeout=3600) for p in procs]
        if codes != [0] * WORLD:
            raise RuntimeError(f"benchmark ranks exited with {codes}")
        return json.loads(out.read_text())


def run(quick: bool) -> None:
    r = _overheads(quick)
    off_step, off_op, off_door, off_p2p = (r[k]["recorder off"] for k in ("steps", "per_op", "door", "door_p2p"))
    goals = {"recorder on (default)": "<= 1.02"}
    rows = [[name, f"{r['steps'][name] * 1e3:.1f}", f"{r['steps'][name] / off_step:.3f}", goals.get(name, "report"),
             f"{r['per_op'][name] * 1e6:.1f}", f"{(r['per_op'][name] - off_op) * 1e6:+.1f}",
             f"{(r['door'][name] - off_door) * 1e6:+.2f}", f"{(r['door_p2p'][name] - off_p2p) * 1e6:+.2f}"]
            for name in SETTINGS]
    print_table(
        f"plait.debug overhead: DDP step (GPT small, batch {BATCH_PER_RANK}/rank, AdamW, {WORLD} ranks Gloo) "
        f"and a 4 KiB all-reduce",
        ["setting", "step ms", "step / off", "goal", "µs per all-reduce", "vs off", "µs added per op, no transport",
         "µs added per p2p op, no transport"],
        rows,
        notes=f"Medians of {r['rounds']} alternating rounds (slowest rank); per-op figures average "
              f"{r['ops']} back-to-back all-reduces on 2 ranks; 'no transport' times {20 * r['ops']} all-reduces "
              f"on a group of one (the door and its listeners alone: {off_door * 1e6:.2f} µs/op with the recorder "
              f"off), and as many sends' events and completed handles without Gloo ({off_p2p * 1e6:.2f} µs/op "
              "off). DETAIL compares fingerprints through the c10d store before every collective (not on a group "
              "of one) and logs every op (here to a file).",
    )
    hang_rows = []
    timeouts = (3.0,) if quick else (3.0, 10.0)
    for mode, env in (("PLAIT_DESYNC_DEBUG=1", {"PLAIT_DESYNC_DEBUG": "1"}),
                      ("DETAIL", {"PLAIT_DISTRIBUTED_DEBUG": "DETAIL"})):
        for t in timeouts:
            h = _hang(t, env)
            hang_rows.append([mode, f"{t:.1f}", f"{h['report']:.2f}", f"{h['exit']:.2f}",
                              f"+{h['exit'] - t:.2f}", "<= +2.00", str(h["codes"])])
    print_table(
        f"plait.debug: from a planted hang to the report and the exit ({WORLD} ranks, rank 1 asleep)",
        ["mode", "timeout s", "report after s", "exit after s", "exit - timeout", "goal", "exit codes"],
        hang_rows,
        notes="Measured from rank 0 entering the stuck all-reduce (its flight-recorder entry) to its dump "
              "being written (the report is printed just before) and to the process ending (seen by the parent).",
    )
