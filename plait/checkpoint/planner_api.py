"""torch's DCP planner interface: the plan records and the SavePlanner / LoadPlanner protocol.

    save: planner.set_up_planner(state_dict, storage_meta, is_coordinator)
          -> create_local_plan() -> SavePlan([WriteItem(index, type, tensor_data)])  every rank
          -> create_global_plan(all_plans) -> (plans, Metadata)                   coordinator
          -> finish_plan(plan) -> resolve_data(item) for each item the writer writes
    load: planner.set_up_planner(state_dict, metadata, is_coordinator)
          -> create_local_plan() -> LoadPlan([ReadItem(dest, storage box)])        every rank
          -> create_global_plan(all_plans) -> finish_plan(plan)
          -> resolve_tensor(item) / commit_tensor(item, t) per tensor box, load_bytes per value

Names, fields and defaults are torch.distributed.checkpoint's (planner.py and metadata.py),
so a planner written against torch's ports by changing imports. `Metadata` here is torch's
record; the JSON file plait writes (plait.checkpoint.metadata.Metadata) offers the same
`state_dict_metadata` view, so a planner reads either.
"""

from __future__ import annotations

import abc
import io
import math
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch


@dataclass
class ChunkStorageMetadata:
    """One saved piece of a tensor: its place in the global tensor."""

    offsets: torch.Size
    sizes: torch.Size


@dataclass
class TensorProperties:
    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False

    @staticmethod
    def create_from_tensor(tensor: torch.Tensor) -> TensorProperties:
        return TensorProperties(dtype=tensor.dtype, layout=tensor.layout, requires_grad=tensor.requires_grad,
                                memory_format=torch.contiguous_format, pin_memory=False)


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: str | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    """torch's checkpoint metadata: fqn -> TensorStorageMetadata | BytesStorageMetadata."""

    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex:
    """Where an item is in the state dict: fqn, and the chunk's offsets for a piece of a tensor.
    `index` is a hint (the chunk's position in its list), not part of equality, as in torch."""

    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset: Any = None, index: int | None = None) -> None:
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "offset", None if offset is None else torch.Size(offset))
        object.__setattr__(self, "index", index)


class WriteItemType(Enum):
    TENSOR = auto()
    SHARD = auto()
    BYTE_IO = auto()


class LoadItemType(Enum):
    TENSOR = auto()
    BYTE_IO = auto()


@dataclass(frozen=True)
class BytesIOWriteData:
    nbytes: int


@dataclass(frozen=True)
class TensorWriteData:
    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: torch.Size  # the global tensor's


@dataclass(frozen=True)
class WriteItem:
    index: MetadataIndex
    type: WriteItemType
    bytes_io_data: BytesIOWriteData | None = None
    tensor_data: TensorWriteData | None = None

    def tensor_storage_size(self) -> int | None:
        """Bytes of the tensor this item belongs to (torch's definition: the global size)."""
        if self.tensor_data is None:
            return None
        return math.prod(self.tensor_data.size) * self.tensor_data.properties.dtype.itemsize


@dataclass(frozen=True)
class ReadItem:
    type: LoadItemType
    dest_index: MetadataIndex  # the state dict entry (offset: the local shard's, in the global tensor)
    dest_offsets: torch.Size  # the box's start inside that local shard
    storage_index: MetadataIndex  # the saved chunk
    storage_offsets: torch.Size  # the box's start inside the saved chunk
    lengths: torch.Size  # the box's size


@dataclass(frozen=True)
class SavePlan:
    items: list[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


@dataclass
class LoadPlan:
    items: list[ReadItem]
    storage_data: Any = None
    planner_data: Any = None


class SavePlanner(abc.ABC):
    """torch's SavePlanner protocol (see the module docstring for the call order)."""

    @abc.abstractmethod
    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None: ...

    @abc.abstractmethod
    def create_local_plan(self) -> SavePlan: ...

    @abc.abstractmethod
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]: ...

    @abc.abstractmethod
    def finish_plan(self, new_plan: SavePlan) -> SavePlan: ...

    @abc.abstractmethod
    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO: ...


class LoadPlanner(abc.ABC):
    """torch's LoadPlanner protocol (see the module docstring for the call order)."""

    @abc.abstractmethod
    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None: ...

    @abc.abstractmethod
    def create_local_plan(self) -> LoadPlan: ...

    @abc.abstractmethod
    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]: ...

    @abc.abstractmethod
    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan: ...

    @abc.abstractmethod
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None: ...

    def resolve_bytes(self, read_item: ReadItem) -> io.BytesIO:
        raise NotImplementedError("LoadPlanner.resolve_bytes is not implemented")

    @abc.abstractmethod
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor: ...

    @abc.abstractmethod
    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None: ...


def state_dict_metadata_of(md: Any) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
    """torch's state_dict_metadata of plait's metadata.json record (metadata.Metadata)."""
    from plait.checkpoint.metadata import dtype_from_name

    out: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, t in md.tensors.items():
        chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks]
        out[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype_from_name(t.dtype)), torch.Size(t.shape), chunks)
    for fqn in md.values:
        out[fqn] = BytesStorageMetadata()
    return out
