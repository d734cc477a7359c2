"""torch's DCP storage interface: StorageWriter / StorageReader, WriteResult, CheckpointException.

    save: writer.reset(checkpoint_id) -> storage_meta() -> set_up_storage_writer(is_coordinator,
          rank=, use_collectives=) -> prepare_local_plan(plan)            every rank
          -> prepare_global_plan(plans)                                   coordinator
          -> write_data(plan, planner) -> Future[list[WriteResult]]       every rank
          -> finish(metadata, results: one list per rank)                coordinator, last
    load: reader.reset(checkpoint_id) -> read_metadata() -> set_up_storage_reader(metadata,
          is_coordinator, rank=, use_collectives=) -> prepare_local_plan -> prepare_global_plan
          -> read_data(plan, planner) -> Future[None]

Names and signatures are torch.distributed.checkpoint.storage's, so a storage layer written
for torch's DCP ports by changing imports. Futures are torch.futures.Future, as torch's
(`wait()` gives the value); a concurrent.futures.Future is accepted too.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any

from torch.futures import Future

from plait.checkpoint.planner_api import (
    LoadPlan,
    LoadPlanner,
    Metadata,
    MetadataIndex,
    SavePlan,
    SavePlanner,
    StorageMeta,
)


@dataclass(frozen=True)
class WriteResult:
    index: MetadataIndex
    size_in_bytes: int
    storage_data: Any  # where the writer put the item: the writer's own record, given back to finish


class CheckpointException(BaseException):
    """A save or load failed on some ranks: raised on every rank, as torch's is.
    `failures` maps each failed rank to its exception (this rank's) or its message (another's)."""

    def __init__(self, msg: str, failures: dict[int, BaseException | str]) -> None:
        super().__init__(msg, failures)
        self._failures = failures

    @property
    def failures(self) -> dict[int, BaseException | str]:
        return self._failures

    def __str__(self) -> str:
        lines = [f"CheckpointException ranks:{sorted(self._failures)}: {self.args[0]}"]
        for rank, exc in sorted(self._failures.items()):
            text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
            lines.append(f"  rank {rank}: {text}")
        return "\n".join(lines)


class StorageWriter(abc.ABC):
    """torch's StorageWriter protocol (see the module docstring for the call order)."""

    @abc.abstractmethod
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None: ...

    @abc.abstractmethod
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan: ...

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]: ...

    @abc.abstractmethod
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]: ...

    @abc.abstractmethod
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None: ...

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool: ...

    def storage_meta(self) -> StorageMeta | None:
        return None


class StorageReader(abc.ABC):
    """torch's StorageReader protocol (see the module docstring for the call order)."""

    @abc.abstractmethod
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None: ...

    @abc.abstractmethod
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata: ...

    @abc.abstractmethod
    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan: ...

    @abc.abstractmethod
    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]: ...

    @abc.abstractmethod
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]: ...

    @classmethod
    @abc.abstractmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool: ...


class PlansAsGiven:
    """The reader half of torch's protocol for a reader that keeps the metadata it is given and
    changes no plan (plait's FileSystemReader and HuggingFaceStorageReader): list it before
    StorageReader among the bases."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans


def done(value: Any) -> Future:
    """A completed torch Future holding `value` (what a synchronous write_data returns)."""
    fut: Future = Future()
    fut.set_result(value)
    return fut


def wait(fut: Any) -> Any:
    """The value of a torch Future (wait) or a concurrent.futures.Future (result)."""
    if hasattr(fut, "wait"):
        fut.wait()
        return fut.value()
    return fut.result()
