"""FileSystemWriter / FileSystemReader: torch's names, a directory of safetensors files.

    writer.write(items, staging, rank) -> files, {fqn: [chunk]}, {file: FileMeta}
        (thread_count threads, a file each: __R_T.safetensors; single_file_per_rank=False:
        a file per chunk)
    reader.read_metadata() -> Metadata          (refuses an incomplete checkpoint, says why;
        metadata.json's own crc32 checked)
    reader.read(reads)                           (each file read from: its size and header
        crc32 checked once; every chunk's crc32 checked; a chunk that is exactly one local
        box is read straight into it, the rest through a buffer)
A corrupt byte raises CorruptCheckpointError naming the file (the tensor where there is
one), the checkpoint, and the previous complete one beside it (integrity.describe).
"""

from __future__ import annotations

import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch

from plait.checkpoint import commit, integrity
from plait.checkpoint.metadata import (
    METADATA_FILE,
    ChunkMeta,
    CorruptCheckpointError,
    FileMeta,
    Metadata,
)
from plait.checkpoint.planner import ReadItem, WriteItem
from plait.checkpoint.safetensors_io import check_file, read_chunk, write_file


def chunk_name(fqn: str, offsets: tuple[int, ...]) -> str:
    return f"{fqn}@{','.join(map(str, offsets))}" if offsets else fqn


class FileSystemWriter:
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

    def _buckets(self, items: list[WriteItem], rank: int) -> list[tuple[str, list[WriteItem]]]:
        if not self.single_file_per_rank:
            return [(f"__{rank}_{i}.safetensors", [it]) for i, it in enumerate(items)]
        n = min(self.thread_count, max(1, len(items)))
        buckets: list[list[WriteItem]] = [[] for _ in range(n)]
        sizes = [0] * n
        for it in sorted(items, key=lambda it: -it.data.numel() * it.data.element_size()):
            i = sizes.index(min(sizes))  # largest first into the emptiest: balanced threads
            buckets[i].append(it)
            sizes[i] += it.data.numel() * it.data.element_size()
        return [(f"__{rank}_{i}.safetensors", b) for i, b in enumerate(buckets) if b]

    def write(self, items: list[WriteItem], staging: str,
              rank: int) -> tuple[list[str], dict[str, list[dict[str, Any]]], dict[str, dict[str, int]]]:
        buckets = self._buckets(items, rank)
        file_meta: dict[str, dict[str, int]] = {}

        def one(name: str, bucket: list[WriteItem]) -> list[tuple[WriteItem, tuple[str, int, int, int]]]:
            written = write_file(os.path.join(staging, name),
                                 [(chunk_name(it.fqn, it.offsets), it.data) for it in bucket], sync=self.sync_files)
            file_meta[name] = asdict(written.file_meta)  # one key per thread: no lock needed
            return list(zip(bucket, written))

        if self.thread_count > 1 and len(buckets) > 1:
            with ThreadPoolExecutor(self.thread_count, thread_name_prefix="plait-ckpt-write") as pool:
                results = list(pool.map(lambda b: one(*b), buckets))
        else:
            results = [one(*b) for b in buckets]
        chunks: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for (file, _), result in zip(buckets, results):
            for it, (name, begin, nbytes, crc) in result:
                chunks[it.fqn].append(asdict(ChunkMeta(list(it.offsets), list(it.sizes), file, name, begin, nbytes, crc)))
        return [f for f, _ in buckets], dict(chunks), file_meta


class FileSystemReader:
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
        where = os.path.join(self.path, METADATA_FILE)
        with open(where, "rb") as f:
            data = f.read()
        try:
            md = Metadata.from_json(data, where=where)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(integrity.describe(self.path, str(e))) from None
        self._file_meta, self._fqns = md.file_meta, defaultdict(list)
        for fqn, t in md.tensors.items():
            for c in t.chunks:
                self._fqns[c.file].append(fqn)
        return md

    def read(self, reads: list[ReadItem]) -> None:
        try:
            self._read(reads)
        except CorruptCheckpointError as e:
            raise type(e)(integrity.describe(self.path, str(e))) from None

    def _read(self, reads: list[ReadItem]) -> None:
        for file in sorted({r.chunk.file for r in reads}):
            if file in self._file_meta:  # absent in a version-1 checkpoint: chunks checked only
                check_file(os.path.join(self.path, file), self._file_meta[file], file=file, fqns=self._fqns[file])
        by_chunk: dict[tuple[str, int], list[ReadItem]] = defaultdict(list)
        for r in reads:
            by_chunk[(r.chunk.file, r.chunk.begin)].append(r)
        for (file, _), group in sorted(by_chunk.items()):
            first = group[0]
            c = first.chunk
            path = os.path.join(self.path, file)
            dst = first.dst
            whole = (len(group) == 1 and list(first.sizes) == list(c.sizes) and dst.is_contiguous()
                     and dst.device.type == "cpu" and dst.dtype == first.dtype)
            if whole:  # straight into the local shard: no buffer, no copy
                read_chunk(path, c, fqn=first.fqn, into=dst.reshape(-1).view(torch.uint8))
                continue
            buf = read_chunk(path, c, fqn=first.fqn)
            src_full = buf.view(first.dtype).view(c.sizes)
            for r in group:
                src = src_full
                for d, (start, n) in enumerate(zip(r.src_offsets, r.sizes)):
                    src = src.narrow(d, start, n)
                r.dst.copy_(src)
