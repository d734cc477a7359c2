"""Atomic commit: a checkpoint directory exists complete, or not at all.

    PATH.incomplete/            created by rank 0, every rank writes its files here,
        __R_T.safetensors       then its fragment __R.fragment.json (temp name + rename)
        __R.fragment.json       {tensors, chunks, values, error} of rank R
    rank 0: all fragments -> merge -> metadata.json (temp name, fsync) -> rename
            PATH.incomplete -> PATH (an older PATH is moved aside first and removed after)

A save killed at any point leaves PATH as it was (the previous checkpoint, loadable) and
at most a PATH.incomplete that `status` reports and the next save to PATH removes. Only
a kill between the two renames of an overwrite leaves PATH.old, which `status` names.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from typing import Any

from plait.checkpoint.metadata import METADATA_FILE, ChunkMeta, FileMeta, Metadata, TensorMeta

INCOMPLETE = ".incomplete"
OLD = ".old"


def staging_dir(path: str) -> str:
    return os.path.normpath(os.fspath(path)) + INCOMPLETE


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin(path: str, *, overwrite: bool) -> str:
    """Rank 0, before anyone writes: a fresh, empty staging directory."""
    path = os.path.normpath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"checkpoint {path} already exists and the writer has overwrite=False")
    staging = staging_dir(path)
    if os.path.exists(staging):
        shutil.rmtree(staging)  # left by a save that was killed
    os.makedirs(staging)
    return staging


def write_json(path: str, body: Any, *, sync: bool) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(body if isinstance(body, str) else json.dumps(body))
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_fragment(staging: str, rank: int, body: dict[str, Any], *, sync: bool) -> None:
    write_json(os.path.join(staging, f"__{rank}.fragment.json"), body, sync=sync)


def _wait_fragments(staging: str, world_size: int, timeout: float) -> list[dict[str, Any]]:
    names = [os.path.join(staging, f"__{r}.fragment.json") for r in range(world_size)]
    deadline, delay = time.monotonic() + timeout, 0.001
    while True:
        missing = [r for r, n in enumerate(names) if not os.path.exists(n)]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint commit waited {timeout:.0f} s for ranks {missing} to finish "
                               f"writing into {staging}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    out = []
    for n in names:
        with open(n) as f:
            out.append(json.load(f))
    return out


def merge(fragments: list[dict[str, Any]]) -> Metadata:
    errors = [f"rank {fr['rank']}: {fr['error']}" for fr in fragments if fr.get("error")]
    if errors:
        raise RuntimeError("checkpoint not committed, a rank failed to write: " + "; ".join(errors))
    tensors: dict[str, TensorMeta] = {}
    values: dict[str, Any] = {}
    files: list[str] = []
    file_meta: dict[str, FileMeta] = {}
    for fr in fragments:  # in rank order: the lowest rank's value of a key wins
        for fqn, t in fr["tensors"].items():
            have = tensors.get(fqn)
            if have is None:
                tensors[fqn] = TensorMeta(t["shape"], t["dtype"], t["layout"])
            elif (have.shape, have.dtype) != (t["shape"], t["dtype"]):
                raise ValueError(f"ranks disagree on tensor {fqn!r}: {have.dtype}{have.shape} on a lower "
                                 f"rank, {t['dtype']}{t['shape']} on rank {fr['rank']}")
        for fqn, chunks in fr["chunks"].items():
            tensors[fqn].chunks.extend(ChunkMeta(**c) for c in chunks)
        for fqn, v in fr["values"].items():
            values.setdefault(fqn, v)
        files.extend(fr["files"])
        file_meta.update((f, FileMeta(**m)) for f, m in fr["file_meta"].items())
    for fqn, t in tensors.items():
        covered = sum(math.prod(c.sizes) for c in t.chunks)
        if covered != math.prod(t.shape):
            raise ValueError(f"tensor {fqn!r} {t.dtype}{t.shape}: the ranks' chunks cover {covered} of "
                             f"{math.prod(t.shape)} elements; ranks hold inconsistent layouts of it")
        t.chunks.sort(key=lambda c: c.offsets)
    unsummed = [f for f in files if f not in file_meta]
    if unsummed:  # every byte is under a checksum, or the save is not committed
        raise ValueError(f"files {unsummed} were written without their size and header checksum")
    return Metadata(tensors, values, len(fragments), files, file_meta)


def finish(path: str, world_size: int, *, sync: bool, timeout: float,
           fragments: list[dict[str, Any]] | None = None) -> Metadata:
    """Rank 0, once every rank has written: metadata last, then the atomic rename.
    `fragments`: the ranks' fragments in hand (the driven save gathered them); None: wait
    for their files (async_save, whose background runs no collective)."""
    path = os.path.normpath(os.fspath(path))
    staging = staging_dir(path)
    on_disk = fragments is None
    metadata = merge(_wait_fragments(staging, world_size, timeout) if on_disk else fragments)
    write_json(os.path.join(staging, METADATA_FILE), metadata.to_json(), sync=sync)
    for r in range(world_size if on_disk else 0):
        os.remove(os.path.join(staging, f"__{r}.fragment.json"))
    if sync:
        _fsync_dir(staging)
    old = None
    if os.path.exists(path):
        old = f"{path}{OLD}"
        if os.path.exists(old):
            shutil.rmtree(old)  # left by a save killed between the renames below
        os.rename(path, old)
    os.rename(staging, path)
    if sync:
        _fsync_dir(os.path.dirname(path) or ".")
    if old is not None:
        # the new checkpoint is committed; removing the one it replaced (~0.1 s per 100 MB
        # here) need not hold the training loop. Not a daemon: the process waits for it.
        # Renamed to a name no later save uses, so the removal never touches a newer PATH.old.
        aside = f"{old}-removing-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(old, aside)
        threading.Thread(target=shutil.rmtree, args=(aside,), kwargs={"ignore_errors": True},
                         name="plait-ckpt-remove-old").start()
    return metadata


def status(path: str) -> str | None:
    """None if PATH is a complete checkpoint, else why not (for load and `verify`)."""
    path = os.path.normpath(os.fspath(path))
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return None
    if os.path.isdir(staging_dir(path)):
        return (f"checkpoint {path} is incomplete: a save was interrupted before its commit "
                f"({staging_dir(path)} holds the partial files; the next save to {path} removes them)")
    if os.path.isdir(path + OLD) and os.path.isfile(os.path.join(path + OLD, METADATA_FILE)):
        return (f"checkpoint {path} is missing but {path + OLD} is complete: a save was killed while "
                f"replacing it; rename {path + OLD} to {path} to load the previous checkpoint")
    if os.path.isdir(path):
        return f"{path} is not a complete plait checkpoint: it has no {METADATA_FILE}"
    return f"no checkpoint at {path}"
