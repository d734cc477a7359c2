"""load: fill a state dict in place from a checkpoint saved in any layout.

    metadata.json (every rank reads it) + flat leaves of the state dict -> load plan:
      per local shard, the saved chunks that overlap it -> read those byte ranges, crc32
      checked -> copy each overlap into the shard; non-tensor values assigned by path
    -> agree (any rank's failure raised on all) -> Stateful members' load_state_dict

Tensors are filled in place (a DTensor's local shard, a plain tensor whole), so the
parameters an optimizer holds are the ones that change, as with torch's DCP.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup

from plait.checkpoint.default_planner import DefaultLoadPlanner
from plait.checkpoint.driver import load_with
from plait.checkpoint.flatten import assign, flatten
from plait.checkpoint.group import Group
from plait.checkpoint.planner_api import LoadPlanner
from plait.checkpoint.stateful import Stateful, expand
from plait.checkpoint.storage import FileSystemReader
from plait.checkpoint.storage_api import StorageReader


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
    if type(reader) is not FileSystemReader or (planner is not None and type(planner) is not DefaultLoadPlanner):
        load_with(state_dict, reader, planner or DefaultLoadPlanner(), group)
        return
    planner = planner or DefaultLoadPlanner()
    error = None
    try:
        metadata = reader.read_metadata()
        expanded, members = expand(state_dict)
        leaves, paths = flatten(expanded, saved={*metadata.tensors, *metadata.values})
        containers = {k for k, v in expanded.items() if isinstance(v, Mapping) or k in members}
        plan = planner.plan_reads(leaves, metadata, where=f"checkpoint {reader.path}",
                                  containers=containers)
        with torch.no_grad():
            reader.read(plan.reads)
    except (ValueError, TypeError, OSError) as e:
        error = e
    group.agree(error)
    for fqn, value in plan.values.items():
        expanded = assign(expanded, paths[fqn], value)
    for k, member in members.items():
        member.load_state_dict(expanded[k])
    for k, v in expanded.items():  # top-level non-tensor values replaced, as torch's load does
        if k not in members and not isinstance(v, Stateful):
            state_dict[k] = v
