"""DefaultSavePlanner / DefaultLoadPlanner: plait's chunk logic behind torch's planner protocol.

    save: set_up_planner(state dict) -> flat leaves -> create_local_plan: one WriteItem per
          chunk this rank holds (a DTensor's piece, SHARD; a plain tensor whole, TENSOR; a
          value, BYTE_IO) -> create_global_plan: one writer per chunk (planner.py's rule),
          Metadata from the items kept -> resolve_data: the chunk's tensor / the value as JSON
    load: set_up_planner(state dict, metadata) -> create_local_plan: per local shard, a
          ReadItem per overlapping saved chunk -> resolve_tensor: the box of the local shard
          to copy into (a view: filled in place) -> load_bytes: the JSON value, assigned by path
          (a custom planner's raw bytes: torch.load(weights_only=True), values.load_raw)

save()/load() drive these (and any subclass, with any storage layer) in torch's order
(driver.py); async_save plans with SaveChunkPlanner.plan_leaves directly. On plait's own
metadata create_local_plan is LoadChunkPlanner.plan_reads (its checks and messages). A value
(BYTE_IO) is JSON (values.encode), never torch.save; a custom planner's bytes (torch.save's,
as torch's planner gives) are kept exactly and read back only with weights_only=True.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from plait.checkpoint import values as values_mod
from plait.checkpoint.flatten import assign, flatten
from plait.checkpoint.metadata import Metadata as FileMetadata
from plait.checkpoint.metadata import safetensors_tag
from plait.checkpoint.planner import (
    LoadChunkPlanner,
    SaveChunkPlanner,
    _layout,
    _overlap,
    local_chunk,
)
from plait.checkpoint.planner_api import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    Metadata,
    MetadataIndex,
    ReadItem,
    SavePlan,
    SavePlanner,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from plait.tensor.dtensor import DTensor

LAYOUTS = "plait_layouts"  # planner_data key: fqn -> the DTensor's mesh and placements


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class DefaultSavePlanner(SaveChunkPlanner, SavePlanner):
    __doc__ = SaveChunkPlanner.__doc__

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        self.state_dict, self.mappings = flatten(state_dict)
        self.storage_meta, self.is_coordinator = storage_meta, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items, layouts = [], {}
        for fqn, v in self.state_dict.items():
            if isinstance(v, DTensor):
                layouts[fqn] = _layout(v)
            if not isinstance(v, torch.Tensor):
                values_mod.encode(v, key=fqn)  # refused here, on every rank alike, not at write time
                items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
                continue
            safetensors_tag(v.dtype, key=fqn)
            found = local_chunk(fqn, v)
            if found is None or not found[2]:  # off the mesh, or a replica another rank writes
                continue
            local, offsets, _ = found
            if local.numel() == 0 and v.numel() > 0:  # an empty piece (uneven shard): its offsets may
                continue  # equal a real piece's, and dedup must not pick it as that piece's writer
            kind = WriteItemType.SHARD if isinstance(v, DTensor) else WriteItemType.TENSOR
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(local.shape))
            items.append(WriteItem(MetadataIndex(fqn, offsets), kind,
                                   tensor_data=TensorWriteData(chunk, TensorProperties.create_from_tensor(local),
                                                               torch.Size(v.shape))))
        # the saved layout, for `plait checkpoint inspect` (FileSystemWriter.finish records it)
        self.plan = SavePlan(items, planner_data={LAYOUTS: layouts})
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """One writer per chunk: round-robin over the holders of each (torch's default), or the
        lowest with dedup_save_to_lowest_rank; a value is the lowest rank's, as torch keeps."""
        holders: dict[tuple, list[int]] = {}
        for r, plan in enumerate(all_plans):
            for it in plan.items:
                holders.setdefault(_key(it), []).append(r)
        owner = {}
        for i, key in enumerate(sorted(holders, key=repr)):
            hs = holders[key]
            lowest = self.dedup_save_to_lowest_rank or key[2] == WriteItemType.BYTE_IO.name
            owner[key] = hs[0] if lowest else hs[i % len(hs)]
        plans = [SavePlan([it for it in p.items if owner[_key(it)] == r], p.storage_data, p.planner_data, p.usable)
                 for r, p in enumerate(all_plans)]
        md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for plan in plans:
            for it in plan.items:
                if it.type == WriteItemType.BYTE_IO:
                    md[it.index.fqn] = BytesStorageMetadata()
                    continue
                td = it.tensor_data
                entry = md.setdefault(it.index.fqn, TensorStorageMetadata(td.properties, td.size, []))
                entry.chunks.append(td.chunk)
        for entry in md.values():
            if isinstance(entry, TensorStorageMetadata):
                entry.chunks.sort(key=lambda c: tuple(c.offsets))
        layouts: dict[str, Any] = {}
        for p in all_plans:
            if isinstance(p.planner_data, dict):
                layouts.update(p.planner_data.get(LAYOUTS, {}))
        return plans, Metadata(state_dict_metadata=md, planner_data={LAYOUTS: layouts},
                               storage_meta=getattr(self, "storage_meta", None))

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        v = self.state_dict[write_item.index.fqn]
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(json.dumps(values_mod.encode(v, key=write_item.index.fqn)).encode())
        return _local(v).detach()


def _key(it: WriteItem) -> tuple:
    return (it.index.fqn, tuple(it.index.offset or ()), it.type.name if it.type == WriteItemType.BYTE_IO else "T")


class DefaultLoadPlanner(LoadChunkPlanner, LoadPlanner):
    __doc__ = LoadChunkPlanner.__doc__

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        if metadata is None:
            raise ValueError("DefaultLoadPlanner.set_up_planner needs the checkpoint's metadata")
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten(state_dict, saved=set(metadata.state_dict_metadata))
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        if isinstance(self.metadata, FileMetadata):  # plait's own: plan_reads, its checks and messages
            return self._plan_from_reads()
        self.report = []
        md = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        for fqn, v in self.state_dict.items():
            entry = md.get(fqn)
            if entry is None:
                self._problem(f"missing key {fqn!r}: the state dict has it, the checkpoint does not")
            elif isinstance(v, torch.Tensor) != isinstance(entry, TensorStorageMetadata):
                raise ValueError(f"state_dict[{fqn!r}] is a {type(v).__name__} but the checkpoint saved "
                              f"{'a tensor' if isinstance(entry, TensorStorageMetadata) else 'a non-tensor value'}")
            elif isinstance(entry, TensorStorageMetadata):
                items.extend(self._reads(fqn, v, entry))
            else:
                zero = torch.Size([0])
                items.append(ReadItem(LoadItemType.BYTE_IO, MetadataIndex(fqn), zero, MetadataIndex(fqn), zero, zero))
        return LoadPlan(items)

    def _plan_from_reads(self) -> LoadPlan:
        """ReadItems from plan_reads' boxes (the same reads as before, and plait's messages:
        missing and unexpected keys, shape and dtype); a saved value: a BYTE_IO item."""
        containers = {k for k, v in self.original_state_dict.items() if isinstance(v, Mapping)}
        plan = self.plan_reads(self.state_dict, self.metadata, where=self.where,
                               containers=containers)
        items: list[ReadItem] = []
        for r in plan.reads:
            dst_offsets = [co + so - sh for co, so, sh in zip(r.chunk.offsets, r.src_offsets, r.shard_offsets)]
            items.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(r.fqn, r.shard_offsets), torch.Size(dst_offsets),
                                  MetadataIndex(r.fqn, r.chunk.offsets), torch.Size(r.src_offsets),
                                  torch.Size(r.sizes)))
        zero = torch.Size([0])
        items.extend(ReadItem(LoadItemType.BYTE_IO, MetadataIndex(fqn), zero, MetadataIndex(fqn), zero, zero)
                     for fqn in plan.values)
        return LoadPlan(items)

    def _reads(self, fqn: str, v: torch.Tensor, entry: TensorStorageMetadata) -> list[ReadItem]:
        if tuple(v.shape) != tuple(entry.size) or v.dtype != entry.properties.dtype:
            raise ValueError(f"state_dict[{fqn!r}] is {v.dtype}{list(v.shape)} but the checkpoint saved "
                             f"{entry.properties.dtype}{list(entry.size)}")
        found = local_chunk(fqn, v)
        if found is None:
            return []
        local, offsets, _ = found
        out, covered = [], 0
        for c in entry.chunks:
            box = _overlap(offsets, local.shape, c.offsets, c.sizes)
            if box is None:
                continue
            lo, size = box
            out.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, offsets),
                                torch.Size([a - o for a, o in zip(lo, offsets)]), MetadataIndex(fqn, c.offsets),
                                torch.Size([a - o for a, o in zip(lo, c.offsets)]), torch.Size(size)))
            covered += math.prod(size)
        if covered != local.numel():
            raise ValueError(f"the checkpoint covers {covered} of the {local.numel()} elements of this rank's "
                             f"piece of {fqn!r}: its chunks do not tile the tensor; the checkpoint is damaged")
        return out

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        data = value.read()
        stored = self.metadata.values.get(read_item.storage_index.fqn) if isinstance(self.metadata, FileMetadata) else None
        if values_mod.raw_bytes(stored) is not None:  # a custom planner's bytes: weights_only=True only
            decoded = values_mod.load_raw(data, key=fqn)
        else:
            decoded = values_mod.decode(json.loads(data))
        self.original_state_dict = assign(self.original_state_dict, self.mappings[fqn], decoded)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        t = _local(self.state_dict[read_item.dest_index.fqn]).detach()
        for d, (start, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, start, n)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor gave a view of the state dict's tensor: the copy into it loaded it
