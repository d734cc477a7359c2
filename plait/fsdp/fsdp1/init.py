"""What FullyShardedDataParallel does before the engine shards a unit: pick the mesh its
strategy needs, materialise meta parameters, and make every rank start from rank 0's.

    (process_group | device_mesh, strategy) -> mesh:
        FULL_SHARD, SHARD_GRAD_OP   1-D (N,), the group's ranks
        NO_SHARD                    2-D (N, 1): replicate over the group, "shard" over one rank
        HYBRID_SHARD, _ZERO2        2-D (R, S) (replicate, shard): a 2-D device_mesh, or a
                                    (shard_group, replicate_group) pair whose grid is gathered
    meta parameters -> param_init_fn(m) for each module of the unit (or to_empty +
        reset_parameters without one), before sharding
    sync_module_states -> broadcast the unit's parameters and buffers from the mesh's first
        rank, one broadcast per dtype and mesh axis, before sharding
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed import ProcessGroup

from plait import comm
from plait.device_mesh import DeviceMesh
from plait.fsdp.fsdp1.api import HYBRID_STRATEGIES, ShardingStrategy


def device_type(device_id: int | torch.device | None) -> str:
    if device_id is not None:
        return torch.device("cuda", device_id).type if isinstance(device_id, int) else torch.device(device_id).type
    return "cuda" if comm.default_backend() == "nccl" else "cpu"


def build_mesh(process_group: ProcessGroup | tuple[ProcessGroup, ProcessGroup] | None,
               device_mesh: DeviceMesh | None, strategy: ShardingStrategy, dtype: str, where: str) -> DeviceMesh:
    """The mesh the engine shards this unit over (see the module docstring)."""
    if process_group is not None and device_mesh is not None:
        raise ValueError(f"{where}: pass process_group or device_mesh, not both")
    hybrid = strategy in HYBRID_STRATEGIES
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"{where}: device_mesh must be a plait.device_mesh.DeviceMesh, got "
                            f"{type(device_mesh).__name__}")
        if hybrid and device_mesh.ndim != 2:
            raise ValueError(f"{where}: {strategy.name} shards within a node and replicates across nodes, "
                             f"so it needs a 2-D (replicate, shard) device_mesh; got a {device_mesh.ndim}-D "
                             f"mesh {device_mesh.shape}: pass init_device_mesh(..., (replicas, shard_size))")
        if not hybrid and device_mesh.ndim != 1:
            raise ValueError(f"{where}: {strategy.name} takes a 1-D device_mesh, got {device_mesh.ndim}-D "
                             f"{device_mesh.shape}; use HYBRID_SHARD for a 2-D (replicate, shard) mesh")
        return _no_shard_mesh(device_mesh.get_group(0), dtype) if strategy is ShardingStrategy.NO_SHARD \
            else device_mesh
    if hybrid:
        if not (isinstance(process_group, tuple) and len(process_group) == 2):
            raise ValueError(f"{where}: {strategy.name} needs a 2-D layout: pass device_mesh="
                             "init_device_mesh(device, (replicas, shard_size)) or process_group=(shard_group, "
                             "replicate_group); plait does not guess the node size")
        return _hybrid_mesh(*process_group, dtype, where)
    if isinstance(process_group, tuple):
        raise ValueError(f"{where}: a (shard_group, replicate_group) pair is for HYBRID_SHARD, not "
                         f"{strategy.name}; pass one process group")
    group = process_group if process_group is not None else comm.world_group()
    if strategy is ShardingStrategy.NO_SHARD:
        return _no_shard_mesh(group, dtype)
    return DeviceMesh.from_group(group, dtype)


def _no_shard_mesh(group: ProcessGroup, dtype: str) -> DeviceMesh:
    ranks = list(comm.group_info(group).ranks)
    me = comm.global_rank()
    return DeviceMesh(dtype, torch.tensor(ranks).view(-1, 1), mesh_dim_names=("replicate", "shard"),
                      _groups=[group, comm.new_group([me])])


def _hybrid_mesh(shard: ProcessGroup, replicate: ProcessGroup, dtype: str, where: str) -> DeviceMesh:
    """The (R, S) grid: every replica's shard ranks, gathered over the replicate group."""
    shard_ranks = torch.tensor(comm.group_info(shard).ranks).view(1, -1)  # (1, S)
    grid = comm.all_gather(shard_ranks, group=replicate)  # (R, S), replica r's shard ranks in row r
    column = grid[:, comm.get_rank(shard)].tolist()
    if column != list(comm.group_info(replicate).ranks):
        raise ValueError(f"{where}: process_group=(shard, replicate) do not form a grid: the replicate group "
                         f"{list(comm.group_info(replicate).ranks)} should hold, in order, this rank's "
                         f"position in every shard group {grid.tolist()}")
    return DeviceMesh(dtype, grid, mesh_dim_names=("replicate", "shard"), _groups=[replicate, shard])


def materialize(modules: Iterable[nn.Module], param_init_fn: Callable[[nn.Module], None] | None,
                device: torch.device, where: str) -> None:
    """Meta parameters or buffers in the unit: param_init_fn(m) for each of its modules, or
    without one, to_empty then reset_parameters() per module (torch's two ways)."""
    modules = list(modules)
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"{where}: param_init_fn must be callable(module), got {type(param_init_fn).__name__}")
    if not any(t.is_meta for m in modules for t in (*m._parameters.values(), *m._buffers.values())
               if t is not None):
        return
    for m in modules:
        if param_init_fn is not None:
            param_init_fn(m)
            continue
        m.to_empty(device=device, recurse=False)
        if callable(getattr(m, "reset_parameters", None)):
            with torch.no_grad():
                m.reset_parameters()
    left = [f"{type(m).__name__}.{k}" for m in modules
            for k, t in (*m._parameters.items(), *m._buffers.items()) if t is not None and t.is_meta]
    if left:
        raise ValueError(f"{where}: {left[:4]} are still on the meta device after "
                         f"{'param_init_fn' if param_init_fn else 'to_empty/reset_parameters'}; "
                         "param_init_fn must materialise every parameter and buffer of the module it gets")


def sync_module_states(modules: Iterable[nn.Module], mesh: DeviceMesh, ignored: set[int], where: str) -> None:
    """Every rank takes the mesh's first rank's parameters and buffers (one broadcast per
    dtype and mesh axis, of everything concatenated)."""
    tensors = []
    for m in modules:
        for key, t in (*m._parameters.items(), *m._buffers.items()):
            if t is None or id(t) in ignored:
                continue
            if t.is_meta:
                raise ValueError(f"{where}: sync_module_states=True broadcasts rank 0's {type(m).__name__}.{key} "
                                 "into every rank's, but this rank's is on the meta device; pass param_init_fn "
                                 "(e.g. lambda m: m.to_empty(device=..., recurse=False)) to allocate it first")
            if all(t is not u for u in tensors):
                tensors.append(t)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        for axis in range(mesh.ndim):  # the first rank of axis 0, then of the last axis
            comm.broadcast(flat, src=0, group=mesh.get_group(axis))
        with torch.no_grad():
            for t, piece in zip(ts, flat.split([t.numel() for t in ts])):
                t.copy_(piece.view_as(t))


__all__ = ["build_mesh", "device_type", "materialize", "sync_module_states"]
