"""Planners: which chunks this rank writes, and which saved pieces each local shard reads.

    save: flat leaves -> ChunkWrites (fqn, offsets, sizes, local data), one writer per chunk
          plain tensor    -> one chunk, the whole tensor, written by one rank of the group
          DTensor         -> this rank's piece (Shard axes cut it, torch.chunk sizes);
                             ranks that hold the same piece along Replicate axes: only the one
                             at coordinate 0 on those axes writes it (dedup); Partial refused
    load: flat leaves + Metadata -> ChunkReads: for each local shard, every saved chunk that
          overlaps it, with the box to copy (src offsets in the chunk, dst offsets in the shard)

async_save calls plan_leaves directly; DefaultLoadPlanner.create_local_plan calls plan_reads
on plait's metadata; default_planner.py puts these classes behind torch's SavePlanner / LoadPlanner
protocol (planner_api.py, re-exported here as torch's ...checkpoint.planner has them).

Both are pure functions of shapes and coordinates, so any saved layout reads into any
current layout: the chunks of a tensor tile it exactly once, and the overlaps of a shard
with them tile the shard exactly once (checked).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.checkpoint import values as values_mod
from plait.checkpoint.metadata import ChunkMeta, Metadata, dtype_name, safetensors_tag
from plait.checkpoint.planner_api import (  # noqa: F401 - torch's import path: ...checkpoint.planner
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from plait.tensor.dtensor import DTensor
from plait.tensor.placement import Partial, Replicate, local_shape_and_offset


@dataclass
class ChunkWrite:
    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    data: torch.Tensor  # this chunk's elements, shape == sizes
    shape: tuple[int, ...]  # the global tensor's
    layout: dict[str, Any]


@dataclass
class ChunkSavePlan:
    items: list[ChunkWrite]
    tensors: dict[str, dict[str, Any]]  # fqn -> {shape, dtype, layout}: every tensor, written here or not
    values: dict[str, Any]  # fqn -> encoded value
    # keys of the chunks this rank could write ("fqn" for a plain tensor, "fqn@offsets" for a
    # DTensor piece): every rank holding an equal chunk lists it, assign_writers keeps one
    candidates: list[str]


@dataclass
class ChunkRead:
    fqn: str
    chunk: ChunkMeta
    dtype: torch.dtype
    src_offsets: tuple[int, ...]  # the box inside the saved chunk
    dst: torch.Tensor  # the box inside the local shard (a view to copy into)
    sizes: tuple[int, ...]
    shard_offsets: tuple[int, ...] = ()  # the local shard's place in the global tensor


@dataclass
class ChunkLoadPlan:
    reads: list[ChunkRead]
    values: dict[str, Any]  # fqn -> the value as stored (load_bytes decodes it)
    report: list[str] = field(default_factory=list)  # problems skipped under allow_partial_load


def _layout(t: torch.Tensor) -> dict[str, Any]:
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        return {"mesh_shape": list(mesh.shape), "mesh_dim_names": list(mesh.mesh_dim_names or ()),
                "placements": [repr(p) for p in t.placements]}
    return {"placements": []}


def local_chunk(fqn: str, t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], bool] | None:
    """(local data, offsets, whether this rank is the piece's writer), None off the mesh."""
    if not isinstance(t, DTensor):
        return t.detach(), (0,) * t.dim(), True
    spec = t._spec
    for p in spec.placements:
        if isinstance(p, Partial):
            raise ValueError(f"state_dict[{fqn!r}] is a DTensor with placements {list(spec.placements)}: "
                             "a Partial value is not the tensor yet; redistribute it to Replicate or "
                             "Shard before saving")
    coordinate = spec.mesh.get_coordinate()
    if coordinate is None:
        return None
    sizes, offsets, writer = piece(spec.shape, spec.placements, spec.mesh.shape, coordinate)
    local = t._local_tensor.detach()
    assert tuple(local.shape) == tuple(sizes), (fqn, tuple(local.shape), sizes)
    return local, offsets, writer


def piece(shape, placements, mesh_shape, coordinate) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(sizes, offsets, writes it) of the piece at `coordinate`: of the ranks holding the
    same piece (they differ only along Replicate axes), the one at 0 on those axes writes."""
    sizes, offsets = local_shape_and_offset(shape, placements, mesh_shape, coordinate)
    writer = all(c == 0 for c, p in zip(coordinate, placements) if isinstance(p, Replicate))
    return sizes, offsets, writer


class SaveChunkPlanner:
    """The chunk logic of torch's DefaultSavePlanner (default_planner.py adds torch's protocol):
    flatten, dedup replicated chunks, one writer each.

    dedup_save_to_lowest_rank=False (torch's default) spreads the plain (replicated)
    tensors over their holders round-robin so every rank writes a share; True gives each
    to its lowest holder. A DTensor's replicated piece is written by its coordinate-0 holder.
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 dedup_replicated_tensors: bool | None = None, dedup_save_to_lowest_rank: bool = False) -> None:
        if not flatten_state_dict or not flatten_sharded_tensors:
            raise ValueError("plait's checkpoint always flattens the state dict; "
                             "flatten_state_dict/flatten_sharded_tensors=False are not supported")
        del dedup_replicated_tensors  # deprecated in torch too: dedup always happens
        self.dedup_save_to_lowest_rank = dedup_save_to_lowest_rank

    def plan_leaves(self, leaves: dict[str, Any]) -> ChunkSavePlan:
        items: list[ChunkWrite] = []
        tensors: dict[str, dict[str, Any]] = {}
        values: dict[str, Any] = {}
        candidates: list[str] = []
        for fqn, v in leaves.items():
            if not isinstance(v, torch.Tensor):
                # every rank encodes (and so refuses alike); the commit keeps the lowest rank's
                values[fqn] = values_mod.encode(v, key=fqn)
                continue
            safetensors_tag(v.dtype, key=fqn)
            shape = tuple(v.shape)
            tensors[fqn] = {"shape": list(shape), "dtype": dtype_name(v.dtype), "layout": _layout(v)}
            found = local_chunk(fqn, v)
            if found is None:
                continue
            local, offsets, writer = found
            if writer and local.numel() > 0:
                # a plain tensor may be held by many ranks (replicated state) or one (a stage's);
                # a DTensor on a sub-mesh (mesh["dp"] of a (dp, tp) world) by one rank per
                # coordinate of the other axes: assign_writers keeps one holder per chunk
                candidates.append(_chunk_key(fqn, offsets, isinstance(v, DTensor)))
                items.append(ChunkWrite(fqn, tuple(offsets), tuple(local.shape), local, shape, tensors[fqn]["layout"]))
        return ChunkSavePlan(items, tensors, values, candidates)

    def assign_writers(self, plan: ChunkSavePlan, candidates_by_rank: list[list[str]], *, rank: int) -> ChunkSavePlan:
        """Keep the chunks this rank writes: of the ranks holding an equal chunk, one writes it
        (round-robin over the chunks, or the lowest holder with dedup_save_to_lowest_rank)."""
        holders: dict[str, list[int]] = {}
        for r, keys in enumerate(candidates_by_rank):
            for key in keys:
                holders.setdefault(key, []).append(r)
        owner = {}
        for i, key in enumerate(sorted(holders)):
            hs = holders[key]
            owner[key] = hs[0] if self.dedup_save_to_lowest_rank else hs[i % len(hs)]
        plan.items = [it for it, key in zip(plan.items, plan.candidates) if owner[key] == rank]
        return plan


def _chunk_key(fqn: str, offsets, sharded: bool) -> str:
    return f"{fqn}@{','.join(map(str, offsets))}" if sharded else fqn


def _overlap(a_off, a_size, b_off, b_size) -> tuple[list[int], list[int]] | None:
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a_off, a_size, b_off, b_size)]
    if any(h <= a for a, h in zip(lo, hi)):
        return None
    return lo, [h - a for a, h in zip(lo, hi)]


def _missing(fqn: str, v: Any, metadata: Metadata, where: str) -> str:
    msg = f"missing key {fqn!r}: the state dict has it, {where} does not"
    below = [k for k in (*metadata.tensors, *metadata.values) if k.startswith(fqn + ".")]
    if below and v == {}:
        msg += (f" (it saved {len(below)} keys under it, e.g. {below[0]!r}: an optimizer whose state "
                "is not created yet? call plait.checkpoint.state_dict._init_optim_state(optim) first)")
    return msg


def _shown(stored: Any) -> str:
    raw = values_mod.raw_bytes(stored)
    return f"({len(raw)} raw bytes)" if raw is not None else repr(values_mod.decode(stored))


class LoadChunkPlanner:
    """The read logic of torch's DefaultLoadPlanner (default_planner.py adds torch's protocol).
    allow_partial_load=True reports keys missing from the checkpoint and unexpected saved
    keys (warnings, and `self.report`) and skips them instead of raising, as torch's does;
    a key both have in different shapes, dtypes or kinds (tensor, value) is a ValueError
    either way: skipping it would train on with that tensor's fresh init."""

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False) -> None:
        if not flatten_state_dict or not flatten_sharded_tensors:
            raise ValueError("plait's checkpoint always flattens the state dict; "
                             "flatten_state_dict/flatten_sharded_tensors=False are not supported")
        self.allow_partial_load = allow_partial_load
        self.report: list[str] = []
        self.where = "the checkpoint"  # what messages call it (load() names the path)

    def _problem(self, msg: str) -> None:
        if not self.allow_partial_load:
            raise ValueError(msg)
        self.report.append(msg)
        warnings.warn(msg, stacklevel=4)

    def plan_reads(self, leaves: dict[str, Any], metadata: Metadata, *, where: str,
                   containers: set[str]) -> ChunkLoadPlan:
        """`containers`: top-level keys whose whole subtree is being loaded, so a saved key
        under one of them that the state dict lacks means the wrong model or optimizer."""
        self.report = []
        plan = ChunkLoadPlan([], {})
        for fqn, v in leaves.items():
            if isinstance(v, torch.Tensor):
                self._plan_tensor(fqn, v, metadata, where, plan)
            elif fqn in metadata.values:
                plan.values[fqn] = metadata.values[fqn]
            elif fqn in metadata.tensors:
                raise ValueError(f"state_dict[{fqn!r}] is a {type(v).__name__} but {where} saved a tensor "
                                 f"{metadata.tensors[fqn].dtype}{metadata.tensors[fqn].shape} there")
            else:
                self._problem(_missing(fqn, v, metadata, where))
        for fqn in sorted(set(metadata.tensors) | set(metadata.values)):  # after missing: the likelier cause
            if fqn not in leaves and fqn.split(".", 1)[0] in containers:
                self._problem(f"unexpected key {fqn!r}: {where} has it, the state dict being loaded "
                              "does not (a different model? allow_partial_load=True skips it)")
        return plan

    def _plan_tensor(self, fqn: str, v: torch.Tensor, metadata: Metadata, where: str, plan: ChunkLoadPlan) -> None:
        meta = metadata.tensors.get(fqn)
        if meta is None:
            if fqn in metadata.values:
                raise ValueError(f"state_dict[{fqn!r}] is a tensor but {where} saved a "
                                 f"non-tensor value {_shown(metadata.values[fqn])} there")
            else:
                self._problem(_missing(fqn, v, metadata, where))
            return
        if list(v.shape) != list(meta.shape) or dtype_name(v.dtype) != meta.dtype:
            # torch's planner: "Size mismatch between saved ... and current", a ValueError, partial or not
            raise ValueError(f"state_dict[{fqn!r}] is {dtype_name(v.dtype)}{list(v.shape)} but {where} "
                             f"saved {meta.dtype}{meta.shape}")
        found = local_chunk(fqn, v)
        if found is None:
            return
        local, offsets, _ = found
        sizes = tuple(local.shape)
        dtype, covered = v.dtype, 0
        for c in meta.chunks:
            box = _overlap(offsets, sizes, c.offsets, c.sizes)
            if box is None:
                continue
            lo, size = box
            dst = local
            for d, (start, n) in enumerate(zip(lo, size)):
                dst = dst.narrow(d, start - offsets[d], n)
            src = tuple(lo_d - c_d for lo_d, c_d in zip(lo, c.offsets))
            plan.reads.append(ChunkRead(fqn, c, dtype, src, dst, tuple(size), tuple(offsets)))
            covered += math.prod(size)
        if covered != local.numel():
            raise ValueError(f"{where} covers {covered} of the {local.numel()} elements of this rank's "
                             f"piece of {fqn!r} (offsets {list(offsets)}, sizes {list(sizes)}): its chunks "
                             "do not tile the tensor; the checkpoint is damaged")
