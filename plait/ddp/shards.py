"""Data parallel over tensor parallel: DDP works on the local shards of DTensor parameters.

    mesh (dp, tp); params are DTensors on mesh["tp"]; DDP(model, device_mesh=mesh["dp"])
    start-up   shapes checked and rank 0's values broadcast over dp, per local shard
               (ranks of one dp group sit at the same tp coordinate: same local shapes)
    buckets    built over the local shards' sizes (a DTensor's numel is global)
    grad hook  p.grad (a DTensor) -> moved to p's placements if it is not there already
               (a Replicate weight fed Shard(seq) activations gets a Partial gradient:
               all-reduced over tp here, as torch's from_local backward does under DDP+TP)
               -> its _local_tensor into the bucket -> all-reduced over dp
    write-back the averaged local shard becomes p.grad's _local_tensor: p.grad stays a
               DTensor with p's mesh and placements

torch reaches the same gradients another way (torch.distributed.tensor.parallel.ddp's
_pre_dp_module_transform swaps DTensor parameters for plain local ones between forwards);
plait keeps the parameters DTensors throughout, so state_dict and the optimizer see the
tensor-parallel layout at all times. A DTensor parameter must live on a mesh that shares
no rank with the data-parallel group other than this one: DDP replicates over dp, so a
parameter already spread over dp (FSDP's Shard on dp) is not DDP's to reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from plait import comm
from plait.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece: a DTensor's local shard, a plain tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def check_dtensor_params(named: Sequence[tuple[str, torch.Tensor]], group: ProcessGroup) -> None:
    """Refuse DTensor parameters or buffers whose mesh reaches into the data-parallel group."""
    dp_ranks = set(comm.group_info(group).ranks)
    me = comm.global_rank()
    for name, t in named:
        if not isinstance(t, DTensor):
            continue
        mesh_ranks = set(t.device_mesh.mesh.flatten().tolist())
        shared = sorted((mesh_ranks & dp_ranks) - {me})
        if shared:
            raise ValueError(
                f"{name} is a DTensor on {t.device_mesh}, which shares global ranks {shared} with "
                f"the data-parallel group {sorted(dp_ranks)}; data parallel replicates over that "
                "group, so a DTensor parameter must live on the other axes of the mesh: "
                "distribute it on mesh['tp'] and pass device_mesh=mesh['dp']"
            )


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """The local shard of `param.grad`, in `param`'s placements (moved there if needed,
    and `param.grad` replaced by the moved one)."""
    grad = param.grad
    if not isinstance(param, DTensor):
        return grad
    if not isinstance(grad, DTensor):
        raise TypeError(f"a DTensor parameter got a {type(grad).__name__} gradient; "
                        "DDP expects a DTensor gradient on the parameter's mesh")
    if grad.placements != param.placements:
        with torch.no_grad():
            grad = grad.redistribute(param.device_mesh, param.placements)
        param.grad = grad
    return grad._local_tensor


def as_grad(param: torch.Tensor, local_grad: torch.Tensor) -> torch.Tensor:
    """A gradient for `param` holding `local_grad` (shared, not copied) as its shard."""
    if not isinstance(param, DTensor):
        return local_grad
    return DTensor(local_grad, param._spec, requires_grad=False)
