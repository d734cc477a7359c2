"""Hugging Face layout, written by the ranks that own the data: no rank gathers the model.

    save(model_sd, storage_writer=HuggingFaceStorageWriter(path))    (FSDP / TP DTensors, plain)
      every rank: DefaultSavePlanner's plan, one WriteItem per chunk it owns (replicas once)
      coordinator, prepare_global_plan: each tensor -> a file (fqn_to_index_mapping, else
          packed in state-dict order up to max_shard_size, else one file); every file's
          safetensors header (full shapes) written and the file extended to its full size
      every rank, write_data: each chunk's bytes pwritten at their place in the full
          tensor: a dim-0 row range (FSDP's Shard(0)) is one run, a Shard(1) box one run per
          row; several ranks write disjoint ranges of one file at once, and a rank's files
          on thread_count threads
    save_distributed=True, enable_consolidation=False: torch's per-rank shard files instead
      (hf_shards.py), no index
      coordinator, finish: each file fsynced once (after every rank's writes: the pages
          are the file's, whoever wrote them), then model.safetensors.index.json
          {metadata.total_size, weight_map} last (temp name, fsync, rename, the directory
          fsynced): the layout is complete once the index exists
    load(sd, storage_reader=HuggingFaceStorageReader(path))  (hf_reader.py) -> each local shard reads its
      box of every tensor by byte range (any layout; DTensor shards read only their rows);
      torch's shard files too, each tensor of one a chunk at its saved offsets

Memory: a rank holds nothing beyond its own shards (a CPU copy of one chunk at a time
when the shard lives on a GPU); the coordinator holds only headers. Unlike torch's
HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True), which writes
per-rank files and then consolidates them, the files are written once, in place. The
files are safetensors exactly (any safetensors reader opens them); the layout has no
checksums and holds tensors only (a non-tensor value is refused by name).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import re
from typing import Any

import torch

from plait.checkpoint.commit import _fsync_dir as _fsync  # opens read-only: a file or a directory
from plait.checkpoint.hf_shards import (
    SHARD_FILE,
    header,
    in_parallel,
    shard_name,
    write_shard,
)
from plait.checkpoint.planner_api import (
    Metadata,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from plait.checkpoint.storage_api import StorageWriter, WriteResult, done

INDEX_FILE = "model.safetensors.index.json"


def file_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def box_runs(shape, offsets, sizes) -> list[tuple[int, int]]:
    """(start, length) in elements of the contiguous runs of a box of a row-major tensor, in
    the box's own row-major order; the trailing dims the box spans whole merge into one run."""
    n = len(shape)
    k = n
    while k > 0 and offsets[k - 1] == 0 and sizes[k - 1] == shape[k - 1]:
        k -= 1
    if math.prod(sizes) == 0:
        return []
    if k == 0:
        return [(0, math.prod(shape))]
    strides = [math.prod(shape[d + 1:]) for d in range(n)]
    run = sizes[k - 1] * strides[k - 1]
    outer = [range(offsets[d], offsets[d] + sizes[d]) for d in range(k - 1)]
    return [(sum(i * strides[d] for d, i in enumerate(idx)) + offsets[k - 1] * strides[k - 1], run)
            for idx in itertools.product(*outer)]


class HuggingFaceStorageWriter(StorageWriter):
    """torch's HuggingFaceStorageWriter. fqn_to_index_mapping: fqn -> file index 1..N;
    max_shard_size (plait's, bytes): without a mapping, start a new file past this size.
    save_distributed=True, enable_consolidation=False (torch's meaning): every rank writes
    its own shard files, shard-0000r-model-0000k-of-0000n.safetensors, and no index
    (hf_shards.py). Otherwise the consolidated layout, written in place by every rank that
    owns data: what torch's save_distributed=True + enable_consolidation=True produces in
    `path` (plait writes no path/sharded copy on the way), and what torch's default
    (save_distributed=False, a full state dict on one rank) produces, for a full state dict
    or a sharded one. thread_count: a rank's files written by that many threads at once.
    """

    def __init__(self, path: str | os.PathLike, fqn_to_index_mapping: dict[str, int] | None = None,
                 thread_count: int = 1, save_distributed: bool = False, enable_consolidation: bool = False,
                 thread_count_consolidation: int = 1, *, max_shard_size: int | None = None,
                 sync_files: bool = True) -> None:
        if max_shard_size is not None and max_shard_size <= 0:
            raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size}")
        if fqn_to_index_mapping is not None and max_shard_size is not None:
            raise ValueError("give fqn_to_index_mapping or max_shard_size, not both")
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.sharded = save_distributed and not enable_consolidation
        if self.sharded and max_shard_size is not None:
            raise ValueError("max_shard_size splits the consolidated layout; with save_distributed=True and "
                             "enable_consolidation=False each rank writes one file per fqn_to_index_mapping index")
        del thread_count_consolidation  # no consolidation pass: the consolidated files are written in place
        self.path = os.fspath(path)
        self.fqn_to_index_mapping = fqn_to_index_mapping
        self.max_shard_size = max_shard_size
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.save_distributed, self.enable_consolidation = save_distributed, enable_consolidation

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, rank: int = 0, **kwargs: Any) -> None:
        self.rank = rank
        if is_coordinator:  # before the plan exchange, so before any rank writes here
            os.makedirs(self.path, exist_ok=True)
            index = os.path.join(self.path, INDEX_FILE)
            if os.path.exists(index):  # an older layout here is not complete once we start writing
                os.remove(index)
            for name in os.listdir(self.path):  # the other layout's files would be read with this one's
                if SHARD_FILE.match(name) or (self.sharded and re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name)):
                    os.remove(os.path.join(self.path, name))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for it in plan.items:
            if it.type == WriteItemType.BYTE_IO:
                raise ValueError(f"state_dict[{it.index.fqn!r}] is not a tensor: the Hugging Face layout holds "
                                 "tensors only; save the model's state dict (or use FileSystemWriter)")
        return plan

    def _assign(self, tensors: dict[str, tuple[torch.dtype, list[int]]]) -> dict[str, int]:
        if self.fqn_to_index_mapping is not None:
            missing = [f for f in tensors if f not in self.fqn_to_index_mapping]
            if missing:
                raise ValueError(f"fqn_to_index_mapping has no file for {len(missing)} tensor(s), e.g. {missing[0]!r}")
            return {f: self.fqn_to_index_mapping[f] for f in tensors}
        out, k, used = {}, 1, 0
        for fqn, (dtype, shape) in tensors.items():
            nbytes = math.prod(shape) * dtype.itemsize
            if self.max_shard_size is not None and used and used + nbytes > self.max_shard_size:
                k, used = k + 1, 0
            out[fqn], used = k, used + nbytes
        return out

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: the files' layout, their headers written and sizes set; each plan
        learns where its tensors' data begins. Sharded: each plan its shard index (torch's)."""
        if self.sharded:
            mapping = {} if self.fqn_to_index_mapping is None else {"fqn_to_index_mapping": self.fqn_to_index_mapping}
            return [dataclasses.replace(p, storage_data={"shard_index": i, **mapping}) for i, p in enumerate(plans, 1)]
        tensors: dict[str, tuple[torch.dtype, list[int]]] = {}
        for plan in plans:
            for it in plan.items:
                tensors.setdefault(it.index.fqn, (it.tensor_data.properties.dtype, list(it.tensor_data.size)))
        index_of = self._assign(tensors)
        ks = sorted(set(index_of.values()))
        if ks and ks != list(range(1, len(ks) + 1)):
            raise ValueError(f"fqn_to_index_mapping uses file indices {ks}: they must be 1..N without gaps")
        self.weight_map, place = {}, {}
        for k in ks:
            name = file_name(k, len(ks))
            members = [(f, dtype, shape) for f, (dtype, shape) in tensors.items() if index_of[f] == k]
            raw, begins = header(members)
            with open(os.path.join(self.path, name), "wb") as fh:
                fh.write(raw)
                fh.truncate(begins[members[-1][0]] + math.prod(members[-1][2]) * members[-1][1].itemsize)
            for f, _, _ in members:
                self.weight_map[f], place[f] = name, (name, begins[f])
        self.total_size = sum(math.prod(s) * d.itemsize for d, s in tensors.values())
        return [dataclasses.replace(p, storage_data={it.index.fqn: place[it.index.fqn] for it in p.items})
                for p in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        per_file: dict[str, list] = {}  # file -> [(item, its data)]: one thread's work
        for it in plan.items:
            name = self._shard_file(plan, it) if self.sharded else plan.storage_data[it.index.fqn][0]
            per_file.setdefault(name, []).append((it, planner.resolve_data(it)))
        one = self._write_shard if self.sharded else functools.partial(self._write_in_place, plan)
        tasks = [functools.partial(one, name, jobs) for name, jobs in per_file.items()]
        return done([r for rs in in_parallel(tasks, self.thread_count) for r in rs])

    def _shard_file(self, plan: SavePlan, it) -> str:
        mapping = plan.storage_data.get("fqn_to_index_mapping")
        k = 1 if mapping is None else mapping[it.index.fqn]
        return shard_name(plan.storage_data["shard_index"], k, 1 if mapping is None else max(mapping.values()))

    @staticmethod
    def _cpu(it, data: torch.Tensor) -> torch.Tensor:
        return data.detach().to("cpu", it.tensor_data.properties.dtype).contiguous()

    def _write_shard(self, name: str, jobs: list) -> list[WriteResult]:
        chunks = [(it.index.fqn, list(it.tensor_data.chunk.offsets), self._cpu(it, data)) for it, data in jobs]
        write_shard(os.path.join(self.path, name), chunks, sync=self.sync_files)
        return [WriteResult(it.index, t.numel() * t.element_size(), {"file": name})
                for (it, _), (_, _, t) in zip(jobs, chunks)]

    def _write_in_place(self, plan: SavePlan, name: str, jobs: list) -> list[WriteResult]:
        """This rank's chunks of one consolidated file, each run pwritten at its place."""
        results = []
        fd = os.open(os.path.join(self.path, name), os.O_WRONLY)
        try:
            for it, data in jobs:
                begin = plan.storage_data[it.index.fqn][1]
                td = it.tensor_data
                data = self._cpu(it, data)
                flat = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else None
                size, pos = td.properties.dtype.itemsize, 0
                for start, n in box_runs(list(td.size), list(td.chunk.offsets), list(td.chunk.sizes)):
                    os.pwrite(fd, flat[pos:pos + n * size], begin + start * size)
                    pos += n * size
                results.append(WriteResult(it.index, pos, {"file": name}))
        finally:
            os.close(fd)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        written: dict[str, int] = {}
        for r in itertools.chain.from_iterable(results):
            written[r.index.fqn] = written.get(r.index.fqn, 0) + r.size_in_bytes
        for fqn, e in metadata.state_dict_metadata.items():
            want = math.prod(e.size) * e.properties.dtype.itemsize
            if written.get(fqn, 0) != want:
                raise ValueError(f"tensor {fqn!r}: the ranks wrote {written.get(fqn, 0)} of its {want} bytes; "
                                 "ranks hold inconsistent layouts of it")
        if self.sharded:
            return  # torch writes no index for shard files: a tensor's chunks lie in several
        if self.sync_files:  # every rank has written: one flush per file, whoever wrote its pages
            in_parallel([functools.partial(_fsync, os.path.join(self.path, name))
                         for name in sorted(set(self.weight_map.values()))], self.thread_count)
        body = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
        tmp = os.path.join(self.path, INDEX_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(body, f, indent=2)
            if self.sync_files:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.path, INDEX_FILE))
        if self.sync_files:  # the index's rename (the layout's commit) is durable too
            _fsync(self.path)

