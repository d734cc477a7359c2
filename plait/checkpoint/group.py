"""The process group a save or load runs over, and the few exchanges it needs.

    Group(process_group)      -- None: the default group if one is initialized, else one process
                                 (no_dist=True: one process)
    .gather_json(obj)         -- every rank's JSON-able obj, in rank order (all_gather via plait.comm)
    .agree(error, payload)    -- every rank's payload, or raise on every rank if any rank failed
                                 (so no rank waits forever for one that already raised)
    .gather_to_coordinator(obj) / .scatter_from_coordinator(objs)
                              -- torch's gather / scatter of plans: rank 0 receives every rank's
                                 obj, rank r receives objs[r] (all_to_all with one nonzero piece)
    .failures(message)        -- every rank's failure message, {} when none failed: one all_reduce
                                 of a flag; the messages travel only when some rank failed
    .from_coordinator(obj)    -- rank 0's JSON-able obj on every rank; None (the success case of
                                 a commit) costs one broadcast of its length, 0

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
    def __init__(self, process_group: ProcessGroup | None, *, no_dist: bool = False) -> None:
        if no_dist:  # torch's no_dist=True: this process alone, even inside a job
            process_group = None
        elif process_group is None and comm.is_initialized():
            process_group = comm.world_group()
        self.pg = process_group
        self.rank = comm.get_rank(process_group) if process_group is not None else 0
        self.size = comm.get_world_size(process_group) if process_group is not None else 1
        # the exchanges go where the group takes tensors; JSON is decoded from a host copy
        self.device = comm.group_device(process_group) if process_group is not None else torch.device("cpu")

    def gather_json(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        data = data.to(self.device)
        n = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
        sizes = [int(s) for s in comm.all_gather(n, group=self.pg)]
        joined = comm.all_gather(data, group=self.pg, sizes=sizes).cpu().numpy().tobytes()
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

    def _to_bytes(self, obj: Any) -> torch.Tensor:
        return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(self.device)

    def gather_to_coordinator(self, obj: Any) -> list[Any] | None:
        """Collective: every rank's JSON-able obj on rank 0 (rank order); None elsewhere."""
        if self.size == 1:
            return [obj]
        data = self._to_bytes(obj)
        sizes = [int(s) for s in comm.all_gather(torch.tensor([data.numel()], dtype=torch.int64, device=self.device), group=self.pg)]
        to_coordinator = [data.numel()] + [0] * (self.size - 1)
        got = comm.all_to_all(data, group=self.pg, input_split_sizes=to_coordinator,
                              output_split_sizes=sizes if self.rank == 0 else [0] * self.size)
        if self.rank != 0:
            return None
        joined, out, start = got.cpu().numpy().tobytes(), [], 0
        for s in sizes:
            out.append(json.loads(joined[start:start + s]))
            start += s
        return out

    def scatter_from_coordinator(self, objs: list[Any] | None) -> Any:
        """Collective: objs[r] (given on rank 0, one per rank) on rank r."""
        if self.size == 1:
            return objs[0]
        if self.rank == 0:
            assert objs is not None and len(objs) == self.size, (self.size, None if objs is None else len(objs))
            encoded: dict[int, torch.Tensor] = {}  # the same object for many ranks: serialized once
            blobs = [encoded[id(o)] if id(o) in encoded else encoded.setdefault(id(o), self._to_bytes(o))
                     for o in objs]
            sizes = torch.tensor([b.numel() for b in blobs], dtype=torch.int64, device=self.device)
            data = torch.cat(blobs)
        else:
            sizes = torch.zeros(self.size, dtype=torch.int64, device=self.device)
            data = torch.empty(0, dtype=torch.uint8, device=self.device)
        comm.broadcast(sizes, src=0, group=self.pg)
        mine = [int(sizes[self.rank])] + [0] * (self.size - 1)
        got = comm.all_to_all(data, group=self.pg, output_split_sizes=mine,
                              input_split_sizes=[int(s) for s in sizes] if self.rank == 0 else [0] * self.size)
        return json.loads(got.cpu().numpy().tobytes())

    def failures(self, message: str | None) -> dict[int, str]:
        """Collective: {rank: message} of the ranks whose `message` is not None."""
        if self.size == 1:
            return {} if message is None else {0: message}
        flag = torch.tensor([0 if message is None else 1], dtype=torch.int64, device=self.device)
        comm.all_reduce(flag, group=self.pg, op="max")
        if not int(flag):
            return {}
        return {r: m for r, m in enumerate(self.gather_json(message)) if m is not None}

    def from_coordinator(self, obj: Any) -> Any:
        """Collective: rank 0's obj (JSON-able) on every rank."""
        if self.size == 1:
            return obj
        data = self._to_bytes(obj) if self.rank == 0 and obj is not None else None
        n = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=self.device)
        comm.broadcast(n, src=0, group=self.pg)
        if not int(n):
            return None
        if data is None:
            data = torch.empty(int(n), dtype=torch.uint8, device=self.device)
        comm.broadcast(data, src=0, group=self.pg)
        return json.loads(data.cpu().numpy().tobytes())
