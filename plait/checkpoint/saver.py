"""save: every rank writes the chunks it owns, in parallel; rank 0 commits.

    save(): torch's order on the planner and writer (driver.py), the built-in ones too:
      set_up_planner -> set_up_storage_writer (rank 0 makes PATH.incomplete) ->
      create_local_plan -> [gather] create_global_plan (one writer per chunk) -> [scatter]
      finish_plan -> write_data (own files, crc32 as written) -> [gather] finish (rank 0:
      metadata.json, fsync, rename) -> [broadcast] its outcome -> every rank returns plait's
      Metadata (rank 0 its record, the others read metadata.json)
    async_save(): prepare (plan + agree) here, write_own + commit on its thread (async_saver.py)

Every failure, on any rank, is raised on every rank at the next exchange, so no rank is
left waiting; the checkpoint is then not committed, PATH.incomplete is removed and the
previous checkpoint at PATH is untouched. With the built-in planner and writer this rank's
own error is raised as it was (ValueError naming the key), another rank's as
CheckpointError; a custom one gets torch's CheckpointException.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

from torch.distributed import ProcessGroup

from plait.checkpoint import commit
from plait.checkpoint.default_planner import DefaultSavePlanner
from plait.checkpoint.driver import save_with
from plait.checkpoint.flatten import flatten
from plait.checkpoint.group import CheckpointError, Group
from plait.checkpoint.metadata import Metadata
from plait.checkpoint.planner import ChunkSavePlan, ChunkWrite
from plait.checkpoint.planner_api import SavePlanner
from plait.checkpoint.stateful import expand
from plait.checkpoint.storage import FileSystemWriter
from plait.checkpoint.storage_api import CheckpointException, StorageWriter

COMMIT_TIMEOUT_S = 1800.0  # rank 0 waits this long for the other ranks' files (async save)


def resolve_writer(checkpoint_id: str | os.PathLike | None, storage_writer: StorageWriter | None) -> StorageWriter:
    if storage_writer is None:
        if checkpoint_id is None:
            raise ValueError("give checkpoint_id (a directory path) or storage_writer=FileSystemWriter(path)")
        return FileSystemWriter(checkpoint_id)
    if not isinstance(storage_writer, StorageWriter):
        raise TypeError("storage_writer must be a plait.checkpoint.StorageWriter (FileSystemWriter, "
                        f"HuggingFaceStorageWriter or your subclass), got {type(storage_writer).__name__}")
    if checkpoint_id is not None:  # torch resets a given storage layer only to a new id
        storage_writer.reset(checkpoint_id)
    return storage_writer


def is_direct(writer: StorageWriter, planner: SavePlanner | None) -> bool:
    """The built-in planner and writer: save keeps plait's errors for them (builtin_errors),
    async_save splits their write off to a thread (prepare / write_own)."""
    return type(writer) is FileSystemWriter and (planner is None or type(planner) is DefaultSavePlanner)


@dataclass
class Prepared:
    writer: FileSystemWriter
    group: Group
    plan: ChunkSavePlan
    staging: str


def prepare(state_dict: dict[str, Any], checkpoint_id, storage_writer, planner, process_group, no_dist: bool) -> Prepared:
    """Plan on every rank and open the staging directory: the collective part before writing."""
    writer = resolve_writer(checkpoint_id, storage_writer)
    if not is_direct(writer, planner):
        raise TypeError(f"async_save drives plait's DefaultSavePlanner and FileSystemWriter only, got planner "
                        f"{type(planner).__name__}, storage_writer {type(writer).__name__}: use save() for them")
    planner = planner or DefaultSavePlanner()
    group = Group(process_group, no_dist=no_dist)
    error, plan = None, None
    try:
        expanded, _ = expand(state_dict)
        leaves, _ = flatten(expanded)
        plan = planner.plan_leaves(leaves)
        if group.rank == 0:
            commit.begin(writer.path, overwrite=writer.overwrite)
    except (ValueError, TypeError, OSError) as e:
        error = e
    candidates_by_rank = group.agree(error, plan.candidates if plan else None)
    plan = planner.assign_writers(plan, candidates_by_rank, rank=group.rank)
    return Prepared(writer, group, plan, commit.staging_dir(writer.path))


def write_own(p: Prepared, items: list[ChunkWrite]) -> BaseException | None:
    """Write this rank's files and its fragment; the error, if any, goes in the fragment."""
    error, files, chunks, file_meta = None, [], {}, {}
    try:
        files, chunks, file_meta = p.writer.write(items, p.staging, p.group.rank)
    except Exception as e:  # noqa: BLE001 - any failure must reach the fragment, or rank 0 waits for it
        error = e
    body = {"rank": p.group.rank, "tensors": p.plan.tensors, "chunks": chunks, "values": p.plan.values,
            "files": files, "file_meta": file_meta, "error": None if error is None else f"{type(error).__name__}: {error}"}
    try:
        # not fsynced: rank 0 reads it at once and removes it; durability is metadata.json's job
        commit.write_fragment(p.staging, p.group.rank, body, sync=False)
    except OSError as e:
        error = error or e
    return error


def read_committed(path: str) -> Metadata:
    from plait.checkpoint.validate import read

    return read(path)


def builtin_errors(e: CheckpointException, group: Group) -> BaseException:
    """The built-in planner and writer keep plait's errors: this rank's own (a ValueError
    naming the key, an OSError) as it was raised, another rank's as CheckpointError."""
    own = e.failures.get(group.rank)
    if isinstance(own, BaseException):
        return own
    r = min(e.failures)
    return CheckpointError(f"checkpoint failed on rank {r} ({len(e.failures)} rank(s) failed): {e.failures[r]}")


def save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
         process_group: ProcessGroup | None = None, no_dist: bool = False) -> Metadata:
    """Save `state_dict` (plain tensors, DTensors, Stateful members, JSON-able values) to the
    directory `checkpoint_id`, every rank writing its own chunks. Collective over
    `process_group` (default: the world, or this process alone when none is initialized or
    no_dist=True). The planner (DefaultSavePlanner) and writer (FileSystemWriter) are driven
    in torch's call order (driver.py), the built-in ones as a custom one."""
    from plait.checkpoint.async_saver import wait_previous  # async_saver builds on this module

    wait_previous()
    writer = resolve_writer(checkpoint_id, storage_writer)
    group = Group(process_group, no_dist=no_dist)
    if not is_direct(writer, planner):
        return save_with(state_dict, writer, planner or DefaultSavePlanner(), group)
    try:
        save_with(state_dict, writer, planner or DefaultSavePlanner(), group, return_metadata=False)
    except CheckpointException as e:
        if group.rank == 0:  # every rank is past its writes (the driver's steps are collective):
            shutil.rmtree(commit.staging_dir(writer.path), ignore_errors=True)  # nothing half-written stays
        raise builtin_errors(e, group) from None
    # plait's record of the commit (it also has torch's state_dict_metadata view), on every rank
    committed = getattr(writer, "committed", None) if group.rank == 0 else None
    return committed if committed is not None else read_committed(os.path.normpath(writer.path))
