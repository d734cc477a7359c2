"""save_state_dict / load_state_dict: the names torch.distributed.checkpoint still exports.

torch deprecates both (a FutureWarning: use `save` / `load`); here, as there, each resets the
storage layer given and calls the current function, so old scripts keep working while they
are told to move. `coordinator_rank` is torch's argument: it picks which rank writes the
metadata. plait's commit is always rank 0 of the group (the checkpoint written is the same
whichever rank commits), so any rank of the group is accepted and rank 0 commits.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.distributed import ProcessGroup

from plait.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from plait.checkpoint.loader import load
from plait.checkpoint.metadata import Metadata
from plait.checkpoint.saver import save
from plait.checkpoint.storage import FileSystemReader, FileSystemWriter


def _check_coordinator(coordinator_rank: int) -> None:
    if not isinstance(coordinator_rank, int) or coordinator_rank < 0:
        raise ValueError(f"coordinator_rank must be a rank (an int >= 0), got {coordinator_rank!r}")


def save_state_dict(state_dict: dict[str, Any], storage_writer: FileSystemWriter,
                    process_group: ProcessGroup | None = None, coordinator_rank: int = 0,
                    no_dist: bool = False, planner: DefaultSavePlanner | None = None) -> Metadata:
    """This method is deprecated. Please switch to 'save'."""
    warnings.warn("`save_state_dict` is deprecated and will be removed in future versions. "
                  "Please use `save` instead.", FutureWarning, stacklevel=2)
    _check_coordinator(coordinator_rank)
    storage_writer.reset()
    return save(state_dict, storage_writer=storage_writer, planner=planner, process_group=process_group,
                no_dist=no_dist)


def load_state_dict(state_dict: dict[str, Any], storage_reader: FileSystemReader,
                    process_group: ProcessGroup | None = None, coordinator_rank: int = 0,
                    no_dist: bool = False, planner: DefaultLoadPlanner | None = None) -> None:
    """This method is deprecated. Please switch to 'load'."""
    warnings.warn("`load_state_dict` is deprecated and will be removed in future versions. "
                  "Please use `load` instead.", FutureWarning, stacklevel=2)
    _check_coordinator(coordinator_rank)
    storage_reader.reset()
    load(state_dict, storage_reader=storage_reader, planner=planner, process_group=process_group,
         no_dist=no_dist)
