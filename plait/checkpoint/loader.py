"""load: fill a state dict in place from a checkpoint saved in any layout.

    torch's order on the planner and reader (driver.py), the built-in ones too:
      read_metadata (metadata.json, its crc32) -> set_up_planner -> set_up_storage_reader ->
      create_local_plan (per local shard, the saved chunks that overlap it) -> [gather]
      create_global_plan -> [scatter] (the built-ins' identity hooks: skipped, an all_reduce
      of failure flags instead, driver.py) finish_plan -> read_data (each file's size and header
      crc32, each chunk's crc32; boxes copied into the shards, values via load_bytes)
    -> [all_reduce] any rank's failure raised on all -> Stateful members' load_state_dict

Tensors are filled in place (a DTensor's local shard, a plain tensor whole), so the
parameters an optimizer holds are the ones that change, as with torch's DCP. With the
built-in planner and reader this rank's own error is raised as it was (ValueError,
CorruptCheckpointError), another rank's as CheckpointError.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed import ProcessGroup

from plait.checkpoint.default_planner import DefaultLoadPlanner
from plait.checkpoint.driver import load_with
from plait.checkpoint.group import Group
from plait.checkpoint.planner_api import LoadPlanner
from plait.checkpoint.saver import builtin_errors
from plait.checkpoint.storage import FileSystemReader
from plait.checkpoint.storage_api import CheckpointException, StorageReader


def resolve_reader(checkpoint_id: str | os.PathLike | None, storage_reader: StorageReader | None) -> StorageReader:
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("give checkpoint_id (a checkpoint directory) or storage_reader=FileSystemReader(path)")
        return FileSystemReader(checkpoint_id)
    if not isinstance(storage_reader, StorageReader):
        raise TypeError("storage_reader must be a plait.checkpoint.StorageReader (FileSystemReader, "
                        f"HuggingFaceStorageReader or your subclass), got {type(storage_reader).__name__}")
    if checkpoint_id is not None:  # torch resets a given storage layer only to a new id
        storage_reader.reset(checkpoint_id)
    return storage_reader


def load(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
         storage_reader: StorageReader | None = None, planner: LoadPlanner | None = None,
         process_group: ProcessGroup | None = None, no_dist: bool = False) -> None:
    """Load the checkpoint at `checkpoint_id` into `state_dict` in place, resharding every
    tensor from the layout it was saved with to the one it has now. Collective. A custom
    LoadPlanner / StorageReader is driven in torch's call order (driver.py)."""
    reader = resolve_reader(checkpoint_id, storage_reader)
    group = Group(process_group, no_dist=no_dist)
    builtin = type(reader) is FileSystemReader and (planner is None or type(planner) is DefaultLoadPlanner)
    if not builtin:
        load_with(state_dict, reader, planner or DefaultLoadPlanner(), group)
        return
    planner = planner or DefaultLoadPlanner()
    planner.where = f"checkpoint {reader.path}"  # named in its messages (a missing key, a shape)
    try:
        load_with(state_dict, reader, planner, group)
    except CheckpointException as e:
        raise builtin_errors(e, group) from None
