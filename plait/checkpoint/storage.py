"""FileSystemWriter / FileSystemReader: torch's names, a directory of safetensors files.

    writer.write(items, staging, rank) -> files, {fqn: [chunk]}, {file: FileMeta}
        (thread_count threads, a file each: __R_T.safetensors; single_file_per_rank=False:
        a file per chunk)
    reader.read_metadata() -> Metadata          (refuses an incomplete checkpoint, says why;
        metadata.json's own crc32 and every field checked: validate.py; files opened
        only inside the folder, regular files, no links: confine.py)
A corrupt byte raises CorruptCheckpointError naming the file (the tensor where there is
one), the checkpoint, and the previous complete one beside it (integrity.describe).

Both implement torch's StorageWriter / StorageReader protocol (storage_api.py), which
save()/load() drive (driver.py), and a custom storage layer may wrap:
    write_data(plan, planner): resolve_data per item -> the same files -> WriteResults whose
        storage_data is the ChunkMeta and the file's FileMeta (a value: its JSON, or
        {"$raw": base64} of bytes that are not JSON, e.g. a torch planner's torch.save)
    finish(metadata, results): the results as per-rank fragments -> commit.finish (the
        atomic commit async_save's thread also uses); self.committed: plait's Metadata
    read_data(plan, planner): each file read from: its size and header crc32 checked once;
        every chunk's crc32 checked -> resolve_tensor per box; a box that is a whole chunk
        and a contiguous CPU tensor is read straight into it, the rest copy_ from a buffer;
        commit_tensor; a value: load_bytes with the exact bytes saved
"""

from __future__ import annotations

import io
import json
import os
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from plait.checkpoint import commit, integrity, validate
from plait.checkpoint import values as values_mod
from plait.checkpoint.default_planner import LAYOUTS
from plait.checkpoint.metadata import (
    ChunkMeta,
    CorruptCheckpointError,
    FileMeta,
    Metadata,
    dtype_name,
)
from plait.checkpoint.planner import ChunkWrite
from plait.checkpoint.planner_api import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    StorageMeta,
    TensorStorageMetadata,
    WriteItemType,
)
from plait.checkpoint.safetensors_io import check_file, read_chunk, write_file
from plait.checkpoint.storage_api import (  # torch's import path
    PlansAsGiven,
    StorageReader,
    StorageWriter,
    WriteResult,
    done,
)

COMMIT_TIMEOUT_S = 1800.0  # finish() waits this long for the fragments it has just written


def _stored(raw: bytes) -> Any:
    """A BYTE_IO item's bytes as metadata.json keeps them: the JSON value they are when
    json.dumps gives them back exactly (DefaultSavePlanner's values: readable in the file),
    else {"$raw": base64} (a custom planner's, torch.save bytes say), never unpickled here."""
    try:
        value = json.loads(raw)
    except ValueError:
        return values_mod.raw(raw)
    if json.dumps(value).encode() != raw or values_mod.raw_bytes(value) is not None:
        return values_mod.raw(raw)
    return value


def chunk_name(fqn: str, offsets: tuple[int, ...]) -> str:
    return f"{fqn}@{','.join(map(str, offsets))}" if offsets else fqn


class FileSystemWriter(StorageWriter):
    """Writes a checkpoint into directory `path` (torch's FileSystemWriter).

    thread_count: files written in parallel per rank (one file per thread).
    sync_files: fsync every file and the directory before the commit (durability).
    overwrite: False refuses a `path` that already holds a checkpoint.
    """

    def __init__(self, path: str | os.PathLike, single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, *, overwrite: bool = True) -> None:
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.path = os.fspath(path)
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.overwrite = overwrite

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def _buckets(self, items: list[ChunkWrite], rank: int) -> list[tuple[str, list[ChunkWrite]]]:
        if not self.single_file_per_rank:
            return [(f"__{rank}_{i}.safetensors", [it]) for i, it in enumerate(items)]
        n = min(self.thread_count, max(1, len(items)))
        buckets: list[list[ChunkWrite]] = [[] for _ in range(n)]
        sizes = [0] * n
        for it in sorted(items, key=lambda it: -it.data.numel() * it.data.element_size()):
            i = sizes.index(min(sizes))  # largest first into the emptiest: balanced threads
            buckets[i].append(it)
            sizes[i] += it.data.numel() * it.data.element_size()
        return [(f"__{rank}_{i}.safetensors", b) for i, b in enumerate(buckets) if b]

    def write(self, items: list[ChunkWrite], staging: str,
              rank: int) -> tuple[list[str], dict[str, list[dict[str, Any]]], dict[str, dict[str, int]]]:
        buckets = self._buckets(items, rank)
        file_meta: dict[str, dict[str, int]] = {}

        def one(name: str, bucket: list[ChunkWrite]) -> list[tuple[ChunkWrite, tuple[str, int, int, int]]]:
            written = write_file(os.path.join(staging, name),
                                 [(chunk_name(it.fqn, it.offsets), it.data) for it in bucket], sync=self.sync_files)
            file_meta[name] = dict(vars(written.file_meta))  # one key per thread: no lock needed
            return list(zip(bucket, written))

        if self.thread_count > 1 and len(buckets) > 1:
            with ThreadPoolExecutor(self.thread_count, thread_name_prefix="plait-ckpt-write") as pool:
                results = list(pool.map(lambda b: one(*b), buckets))
        else:
            results = [one(*b) for b in buckets]
        chunks: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for (file, _), result in zip(buckets, results):
            for it, (name, begin, nbytes, crc) in result:
                # vars, not asdict: asdict deep-copies field by field (~70 Python calls a chunk)
                chunks[it.fqn].append(dict(vars(ChunkMeta(list(it.offsets), list(it.sizes), file, name, begin, nbytes, crc))))
        return [f for f, _ in buckets], dict(chunks), file_meta

    # torch's StorageWriter protocol (driver.py calls these in torch's order)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=uuid.uuid4().hex)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, rank: int = 0, **kwargs: Any) -> None:
        self.rank, self.is_coordinator = rank, is_coordinator
        if is_coordinator:  # before the plan exchange, so before any rank writes into it
            commit.begin(self.path, overwrite=self.overwrite)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans  # files are named by rank (__R_T.safetensors): nothing to assign centrally

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        results: list[WriteResult] = []
        chunks: list[ChunkWrite] = []
        for it in plan.items:
            data = planner.resolve_data(it)
            if it.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                results.append(WriteResult(it.index, len(raw), {"value": _stored(raw)}))
                continue
            td = it.tensor_data
            if tuple(data.shape) != tuple(td.chunk.sizes):
                raise ValueError(f"resolve_data gave {it.index.fqn!r} shape {list(data.shape)}, the plan's chunk "
                                 f"has sizes {list(td.chunk.sizes)}")
            chunks.append(ChunkWrite(it.index.fqn, tuple(td.chunk.offsets), tuple(td.chunk.sizes),
                                     data.to(td.properties.dtype), tuple(td.size), {}))
        _, written, file_meta = self.write(chunks, commit.staging_dir(self.path), getattr(self, "rank", 0))
        by_key = {(fqn, tuple(c["offsets"])): c for fqn, cs in written.items() for c in cs}
        for it in plan.items:
            if it.type != WriteItemType.BYTE_IO:
                c = by_key[(it.index.fqn, tuple(it.tensor_data.chunk.offsets))]
                results.append(WriteResult(it.index, c["nbytes"], {"chunk": c, "file_meta": file_meta[c["file"]]}))
        return done(results)

    def finish(self, metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: each rank's results as its fragment, then the direct path's commit."""
        fragments: list[dict[str, Any]] = []
        pd = metadata.planner_data
        layouts = pd.get(LAYOUTS, {}) if isinstance(pd, dict) else {}  # DefaultSavePlanner's, if kept
        tensors = {fqn: {"shape": list(e.size), "dtype": dtype_name(e.properties.dtype),
                         "layout": layouts.get(fqn, {"placements": []})}
                   for fqn, e in metadata.state_dict_metadata.items() if isinstance(e, TensorStorageMetadata)}
        for r, rank_results in enumerate(results):
            chunks: dict[str, list[dict[str, Any]]] = defaultdict(list)
            values: dict[str, Any] = {}
            file_meta: dict[str, dict[str, int]] = {}
            for res in rank_results:
                if "value" in res.storage_data:
                    values[res.index.fqn] = res.storage_data["value"]
                else:
                    chunks[res.index.fqn].append(res.storage_data["chunk"])
                    file_meta[res.storage_data["chunk"]["file"]] = res.storage_data["file_meta"]
            fragments.append({"rank": r, "tensors": tensors if r == 0 else {}, "chunks": dict(chunks),
                              "values": values, "files": sorted(file_meta), "file_meta": file_meta, "error": None})
        self.committed = commit.finish(self.path, len(results), sync=self.sync_files, timeout=COMMIT_TIMEOUT_S,
                                       fragments=fragments)


class FileSystemReader(PlansAsGiven, StorageReader):
    """Reads a checkpoint directory written by FileSystemWriter (torch's FileSystemReader)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._file_meta: dict[str, FileMeta] = {}  # from read_metadata: what read checks each file against
        self._fqns: dict[str, list[str]] = {}  # file -> the tensors it holds (for messages)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._file_meta, self._fqns = {}, {}

    def read_metadata(self) -> Metadata:
        problem = commit.status(self.path)
        if problem is not None:
            raise ValueError(problem)
        try:
            md = validate.read(self.path)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(integrity.describe(self.path, str(e))) from None
        self._file_meta, self._fqns = md.file_meta, defaultdict(list)
        for fqn, t in md.tensors.items():
            for c in t.chunks:
                self._fqns[c.file].append(fqn)
        return md

    # torch's StorageReader protocol (driver.py calls these in torch's order)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        try:
            return self._read_data(plan, planner)
        except CorruptCheckpointError as e:
            raise type(e)(integrity.describe(self.path, str(e))) from None

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner):
        md = self.metadata
        by_chunk = defaultdict(list)
        for r in plan.items:
            if r.type == LoadItemType.BYTE_IO:  # the exact bytes resolve_data gave at save
                stored = md.values[r.storage_index.fqn]
                raw = values_mod.raw_bytes(stored)
                planner.load_bytes(r, io.BytesIO(json.dumps(stored).encode() if raw is None else raw))
            else:
                by_chunk[r.storage_index].append(r)
        chunks = {index: md.storage_data.get(index) for index in by_chunk}
        fqns = self._fqns if self._file_meta is md.file_meta else None  # read_metadata's, else found here
        for file in sorted({c.file for c in chunks.values() if c is not None}):
            if file in md.file_meta:  # absent in a version-1 checkpoint: chunks checked only
                held = fqns[file] if fqns is not None else [f for f, t in md.tensors.items() for ch in t.chunks
                                                            if ch.file == file]
                check_file(os.path.join(self.path, file), md.file_meta[file], file=file, fqns=held)
        for index, reads in by_chunk.items():
            c = chunks[index]
            if c is None:
                raise ValueError(f"checkpoint {self.path} has no chunk of {index.fqn!r} at offsets "
                                 f"{list(index.offset or ())}: the load plan asks for one it never saved")
            dtype = md.state_dict_metadata[index.fqn].properties.dtype
            path = os.path.join(self.path, c.file)
            whole = len(reads) == 1 and list(reads[0].lengths) == list(c.sizes)  # the chunk is one box
            src_full = None
            for r in reads:
                target = planner.resolve_tensor(r).detach()
                if tuple(target.shape) != tuple(r.lengths):
                    raise ValueError(f"resolve_tensor gave {index.fqn!r} shape {list(target.shape)} for a box "
                                     f"of {list(r.lengths)}")
                if whole and target.is_contiguous() and target.dtype == dtype and target.device.type == "cpu":
                    read_chunk(path, c, fqn=index.fqn, into=target.reshape(-1).view(torch.uint8))  # no buffer
                else:
                    if src_full is None:
                        src_full = read_chunk(path, c, fqn=index.fqn).view(dtype).view(c.sizes)
                    src = src_full
                    for d, (begin, n) in enumerate(zip(r.storage_offsets, r.lengths)):
                        src = src.narrow(d, begin, n)
                    target.copy_(src)
                planner.commit_tensor(r, target)
        return done(None)
