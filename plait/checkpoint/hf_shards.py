"""torch's save_distributed=True layout without consolidation: each rank's own shard files.

    rank r (shard index r+1), file index k of n (fqn_to_index_mapping, else 1 of 1):
      shard-{r+1:05d}-model-{k:05d}-of-{n:05d}.safetensors: the chunks rank r writes, each
      stored whole under its fqn; the header's __metadata__ records where each lies:
      {"DCP_SHARDING_INFO": json {fqn: {"saved_offsets": [...]}}, "DCP_VERSION": "1.0", "format": "pt"}
    no index file: a tensor's chunks lie in several files (torch writes none either)
    read back: HuggingFaceStorageReader takes each such tensor as a chunk at its saved
      offsets, the global size the largest offset + shape per dim (torch's reader's rule)

torch's names and header keys, so torch's HuggingFaceStorageReader reads these files and
plait's reads torch's. `in_parallel` runs a rank's files on thread_count threads (pwrite,
write and fsync release the GIL), as torch's writer spreads its files over its threads.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from plait.checkpoint.confine import open_regular
from plait.checkpoint.metadata import _ST_TAGS, safetensors_tag

SHARDING_KEY = "DCP_SHARDING_INFO"  # torch's _hf_utils names
SHARD_FILE = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors\Z")
T = TypeVar("T")
DTYPES = {tag: dtype for dtype, tag in _ST_TAGS.items()}  # safetensors tag -> dtype


def shard_name(shard_index: int, k: int, n: int) -> str:
    return f"shard-{shard_index:05d}-model-{k:05d}-of-{n:05d}.safetensors"


def header(tensors: Sequence[tuple[str, torch.dtype, list[int]]],
           metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The safetensors header for these tensors in this order (8-byte length prefix
    included), and each one's data begin in the file."""
    head: dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    begins, offset = {}, 0
    for fqn, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        head[fqn] = {"dtype": safetensors_tag(dtype, key=fqn), "shape": shape, "data_offsets": [offset, offset + nbytes]}
        begins[fqn] = offset
        offset += nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data area to 8 bytes
    raw = struct.pack("<Q", len(raw)) + raw
    return raw, {fqn: len(raw) + b for fqn, b in begins.items()}


def in_parallel(tasks: list[Callable[[], T]], thread_count: int) -> list[T]:
    """Each task's result, in order; up to thread_count at once (one file per task)."""
    if thread_count <= 1 or len(tasks) <= 1:
        return [t() for t in tasks]
    with ThreadPoolExecutor(min(thread_count, len(tasks)), thread_name_prefix="plait-hf") as pool:
        return list(pool.map(lambda t: t(), tasks))


def write_shard(path: str, chunks: list[tuple[str, list[int], torch.Tensor]], *, sync: bool) -> None:
    """One shard file: each (fqn, offsets, CPU contiguous tensor) stored whole, in order."""
    info = {fqn: {"saved_offsets": offsets} for fqn, offsets, _ in chunks}
    meta = {SHARDING_KEY: json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"}
    raw, _ = header([(fqn, t.dtype, list(t.shape)) for fqn, _, t in chunks], meta)
    with open(path, "wb") as f:
        f.write(raw)
        for _, _, t in chunks:
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy())
        f.flush()
        if sync:
            os.fsync(f.fileno())


def read_header(path: str) -> tuple[dict[str, tuple[torch.dtype, list[int], int]], dict[str, list[int]] | None]:
    """fqn -> (dtype, shape, absolute byte offset of its data) of one safetensors file, and
    fqn -> saved offsets where the file is one of torch's shards (else None)."""
    with open_regular(path, what=f"file {os.path.basename(path)!r}") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file: {len(raw)} bytes")
        (n,) = struct.unpack("<Q", raw)
        try:
            head = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: its safetensors header is not valid JSON ({e}); the file is damaged") from None
    out = {}
    for fqn, h in head.items():
        if fqn == "__metadata__":
            continue
        if h["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {fqn!r} has dtype {h['dtype']}, which plait does not read")
        out[fqn] = (DTYPES[h["dtype"]], list(h["shape"]), 8 + n + h["data_offsets"][0])
    sharding = (head.get("__metadata__") or {}).get(SHARDING_KEY)
    if sharding is None:
        return out, None
    try:
        offsets = {fqn: list(v["saved_offsets"]) for fqn, v in json.loads(sharding).items()}
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path}: its {SHARDING_KEY} metadata is malformed ({e}); the file is damaged") from None
    missing = sorted(set(out) - set(offsets))
    if missing:
        raise ValueError(f"{path}: {SHARDING_KEY} gives no saved_offsets for {missing[0]!r}")
    return out, offsets
