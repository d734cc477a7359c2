"""async_save: the loop waits only while the state is staged to host memory.

    foreground: wait for the previous save -> plan + agree (collective) -> stage: copy each
                chunk this rank writes into host memory (pinned when it comes from a GPU)
    background (one thread per process): write files + fragment; rank 0 then waits for every
                rank's fragment on the file system and commits -> the Future resolves

A thread, not a process: the write is file I/O and crc32 (zlib-ng's or zlib's), all of which release the
GIL, so the training thread keeps running (measured in benchmarks/bench_checkpoint.py),
and a process would need the staged copy moved to it (a second copy or shared memory)
for nothing. The background part runs no collective, so it never races the training
loop's collectives on the same group: rank 0 learns that the others are done from their
fragment files. Rank 0's Future gives the Metadata (or raises why the commit failed);
another rank's resolves to None once its own files are written.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch
from torch.distributed import ProcessGroup

from plait.checkpoint import commit
from plait.checkpoint.planner import ChunkWrite
from plait.checkpoint.planner_api import SavePlanner
from plait.checkpoint.saver import COMMIT_TIMEOUT_S, Prepared, prepare, write_own
from plait.checkpoint.storage_api import StorageWriter

# One background writer per process, and the save it is running: the next save waits for
# it, so two saves never write at once and staged copies never pile up.
_executor: ThreadPoolExecutor | None = None
_previous: Future | None = None
_lock = threading.Lock()


def stage(items: list[ChunkWrite]) -> list[ChunkWrite]:
    """A host-memory copy of every chunk this rank writes: one staged copy of its share."""
    staged = []
    for it in items:
        pin = it.data.device.type != "cpu"
        # deliberately on the host: the writer thread saves it while training goes on
        host = torch.empty(it.data.shape, dtype=it.data.dtype, device="cpu", pin_memory=pin)
        host.copy_(it.data, non_blocking=pin)
        staged.append(replace(it, data=host))
    if any(it.data.device.type != "cpu" for it in items):
        torch.accelerator.synchronize()  # the non_blocking copies have landed
    return staged


def _background(p: Prepared, items: list[ChunkWrite]):
    error = write_own(p, items)
    if error is not None:
        raise error
    if p.group.rank == 0:
        return commit.finish(p.writer.path, p.group.size, sync=p.writer.sync_files, timeout=COMMIT_TIMEOUT_S)
    return None


def wait_previous() -> None:
    """Wait for this process's running async save, if any (a sync save calls it, so two saves
    never write at once); its failure stays with its Future."""
    with _lock:
        previous = _previous
    if previous is not None:
        try:
            previous.result()
        except Exception:  # noqa: BLE001, S110 - reported by the Future's owner
            pass


def async_save(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
               storage_writer: StorageWriter | None = None, planner: SavePlanner | None = None,
               process_group: ProcessGroup | None = None, no_dist: bool = False) -> Future:
    """torch's async_save: returns once the state is staged; the Future resolves when written."""
    global _executor, _previous
    with _lock:
        previous, _previous = _previous, None
    if previous is not None:
        previous.result()  # the next save waits for the previous (and reports its failure)
    p = prepare(state_dict, checkpoint_id, storage_writer, planner, process_group, no_dist)
    with torch.no_grad():
        items = stage(p.plan.items)
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="plait-async-save")
        _previous = _executor.submit(_background, p, items)
        return _previous
