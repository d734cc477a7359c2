"""Flight-recorder dumps: one JSON file per rank, `<PLAIT_TRACE_DIR>/rank<R>.json`.

    trigger (watchdog, unhandled exception, SIGUSR1, mismatch, dump_flight_recorder())
      -> build(): who (rank, job, pid, host), why (reason), what (groups, entries oldest
         first, in-flight state), where (every thread's stack), plus the report if any
      -> write(): <file>.tmp, then rename — a reader never sees half a dump

The analyzer (`plait debug analyze DIR`) reads exactly this format; DUMP_FORMAT and
DUMP_VERSION (config.py) say which one a file holds.
"""

from __future__ import annotations

import json
import os
import socket
import time

import torch.distributed as dist

from plait.comm import group as comm_group
from plait.debug.callsite import thread_stacks
from plait.debug.config import DUMP_FORMAT, DUMP_VERSION


def global_rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def job_id() -> str | None:
    """What tells this job's dumps from an older job's in the same directory."""
    for name in ("PLAIT_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(name):
            return os.environ[name]
    if os.environ.get("MASTER_PORT"):
        return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ['MASTER_PORT']}"
    return None


def groups() -> dict[str, dict]:
    """Every group this rank has used: members, ops issued, p2p ops per stream."""
    out = {}
    for name, info in list(comm_group._infos.items()):
        out[name] = {
            "ranks": list(info.ranks), "rank": info.rank, "backend": info.backend, "seq": info.seq,
            "p2p": {(f"send->{peer}" if kind == "send" else f"recv<-{peer}"): n
                    for (kind, peer), n in info.p2p_seq.items()},
        }
    return out


def build(entries: list[dict], *, reason: str, buffer_size: int, dropped: int,
          extra: dict | None = None) -> dict:
    in_flight = [e for e in entries if e["state"] != "completed" and not e.get("error")]
    doc = {
        "format": DUMP_FORMAT,
        "version": DUMP_VERSION,
        "rank": global_rank(),
        "world_size": world_size(),
        "job_id": job_id(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "reason": reason,
        "dump_time_ns": time.time_ns(),
        "status": "in op" if in_flight else "running",
        "buffer_size": buffer_size,
        "dropped": dropped,
        "groups": groups(),
        "entries": entries,
        "threads": thread_stacks(),
    }
    if extra:
        doc.update(extra)
    return doc


def path_for(trace_dir: str, rank: int) -> str:
    return os.path.join(trace_dir, f"rank{rank}.json")


def write(doc: dict, trace_dir: str, path: str | None = None) -> str:
    path = path or path_for(trace_dir, doc["rank"])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, default=str)
    os.replace(tmp, path)
    return path
