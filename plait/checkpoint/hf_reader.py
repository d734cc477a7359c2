"""HuggingFaceStorageReader: a Hugging Face layout (or torch's shard files) into any layout.

    read_metadata: every *.safetensors header (the index, when there is one, must list the
      same tensors) -> fqn -> TensorStorageMetadata; a tensor of one of torch's shard files
      (hf_shards.py) is a chunk at its saved offsets, a plain file's a chunk at zero
    read_data: the reads grouped by file, thread_count files at once; each box read by
      byte range, a run per contiguous stretch (box_runs), into a buffer -> copy_ into
      resolve_tensor's view -> commit_tensor

No checksums here: the layout has none (plait's own checkpoints are FileSystemReader's). The
index's file names are plain names inside the folder, opened as regular files only (confine.py).
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any

import torch

from plait.checkpoint.confine import check_name, open_regular
from plait.checkpoint.hf_shards import in_parallel, read_header
from plait.checkpoint.hf_storage import INDEX_FILE, box_runs
from plait.checkpoint.planner_api import (
    ChunkStorageMetadata,
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from plait.checkpoint.storage_api import PlansAsGiven, StorageReader, done


class HuggingFaceStorageReader(PlansAsGiven, StorageReader):
    """torch's HuggingFaceStorageReader: reads model-*.safetensors (+ the index, if any), or
    torch's shard files; thread_count: files read by that many threads at once."""

    def __init__(self, path: str | os.PathLike, thread_count: int = 1) -> None:
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.path = os.fspath(path)
        self.thread_count = thread_count  # files read by that many threads at once, as torch's

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isdir(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index):
            with open_regular(index, what=INDEX_FILE) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted({check_name(n, what=f"{INDEX_FILE}'s weight_map[{k!r}]") for k, n in weight_map.items()})
        else:
            files = sorted(n for n in os.listdir(self.path) if n.endswith(".safetensors")) if os.path.isdir(self.path) else []
            weight_map = None
        if not files:
            raise ValueError(f"no Hugging Face checkpoint at {self.path}: no {INDEX_FILE} and no *.safetensors")
        md: dict[str, TensorStorageMetadata] = {}
        where: dict[MetadataIndex, tuple[str, int, list[int]]] = {}  # chunk -> file, data begin, shape
        for name in files:
            tensors, sharding = read_header(os.path.join(self.path, name))
            for fqn, (dtype, shape, begin) in tensors.items():
                offsets = [0] * len(shape) if sharding is None else sharding[fqn]
                key = MetadataIndex(fqn, torch.Size(offsets))
                if key in where:
                    raise ValueError(f"tensor {fqn!r} at offsets {offsets} is in both {where[key][0]} and {name} "
                                     f"of {self.path}")
                where[key] = (name, begin, shape)
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(shape))
                entry = md.get(fqn)
                if entry is None:
                    md[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(
                        [o + s for o, s in zip(offsets, shape)]), [chunk])
                else:  # torch's rule: the global size is the largest chunk end per dim
                    entry.chunks.append(chunk)
                    entry.size = torch.Size([max(a, o + s) for a, o, s in zip(entry.size, offsets, shape)])
        if weight_map is not None and set(weight_map) != set(md):
            extra = sorted(set(weight_map) ^ set(md))
            raise ValueError(f"{index} and the files' headers disagree on {len(extra)} tensor(s), e.g. {extra[0]!r}")
        return Metadata(state_dict_metadata=md, storage_data=where)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        per_file: dict[str, list] = {}  # file -> its reads: one thread's work (torch's split)
        for r in plan.items:
            if r.type == LoadItemType.BYTE_IO:
                raise ValueError(f"{r.dest_index.fqn!r}: a Hugging Face checkpoint holds tensors only")
            per_file.setdefault(self.metadata.storage_data[r.storage_index][0], []).append(r)
        in_parallel([functools.partial(self._read_file, name, reads, planner) for name, reads in per_file.items()],
                    self.thread_count)
        return done(None)

    def _read_file(self, name: str, reads: list, planner: LoadPlanner) -> None:
        with open_regular(os.path.join(self.path, name), what=f"file {name!r}") as f:
            for r in reads:
                _, begin, shape = self.metadata.storage_data[r.storage_index]
                dtype = self.metadata.state_dict_metadata[r.storage_index.fqn].properties.dtype
                size = dtype.itemsize
                buf = torch.empty(math.prod(r.lengths) * size, dtype=torch.uint8)
                view, pos = buf.numpy(), 0
                for start, n in box_runs(shape, list(r.storage_offsets), list(r.lengths)):
                    f.seek(begin + start * size)
                    got = f.readinto(view[pos:pos + n * size])
                    if got != n * size:
                        raise ValueError(f"{name} of {self.path} is truncated: tensor {r.storage_index.fqn!r} "
                                         f"needs bytes [{begin + start * size}, {begin + (start + n) * size})")
                    pos += n * size
                target = planner.resolve_tensor(r).detach()
                target.copy_(buf.view(dtype).view(r.lengths))
                planner.commit_tensor(r, target)
