"""The process group a save or load runs over, and the few exchanges it needs.

    Group(process_group)      -- None: the default group if one is initialized, else one process
    .gather_json(obj)         -- every rank's JSON-able obj, in rank order (all_gather via plait.comm)
    .agree(error, payload)    -- every rank's payload, or raise on every rank if any rank failed
                                 (so no rank waits forever for one that already raised)

Objects travel as UTF-8 JSON in uint8 tensors (no pickle, unlike all_gather_object).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed import ProcessGroup

from plait import comm


class CheckpointError(RuntimeError):
    """Raised on the ranks that did not fail themselves when another rank's part failed."""


class Group:
    def __init__(self, process_group: ProcessGroup | None) -> None:
        if process_group is None and comm.is_initialized():
            process_group = comm.world_group()
        self.pg = process_group
        self.rank = comm.get_rank(process_group) if process_group is not None else 0
        self.size = comm.get_world_size(process_group) if process_group is not None else 1

    def gather_json(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [int(s) for s in comm.all_gather(n, group=self.pg)]
        joined = comm.all_gather(data, group=self.pg, sizes=sizes).numpy().tobytes()
        out, start = [], 0
        for s in sizes:
            out.append(json.loads(joined[start:start + s]))
            start += s
        return out

    def agree(self, error: BaseException | None, payload: Any = None) -> list[Any]:
        """Collective: every rank's payload; or re-raise this rank's error, or raise another's."""
        msg = None if error is None else f"{type(error).__name__}: {error}"
        got = self.gather_json([msg, payload])
        if error is not None:
            raise error
        failed = [(r, m) for r, (m, _) in enumerate(got) if m is not None]
        if failed:
            r, m = failed[0]
            raise CheckpointError(f"checkpoint failed on rank {r} ({len(failed)} rank(s) failed): {m}")
        return [p for _, p in got]
