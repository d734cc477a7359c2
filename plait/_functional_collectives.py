"""torch.distributed._functional_collectives ("funcol") with plait's mesh as the group.

torch's funcol resolves a `group` argument by isinstance against torch's own DeviceMesh and
refuses any other ("Unsupported group type: <class 'plait.device_mesh.DeviceMesh'>"); plait's
mesh cannot pass for it without being torch's class. Under the porting rule a script's
`funcol.all_reduce(x, "sum", group=mesh)` comes here instead: the group is resolved

    plait DeviceMesh (1-D)         -> its axis's ProcessGroup
    (plait DeviceMesh, axis)       -> that axis's ProcessGroup (an int, as torch's, or a name)
    ProcessGroup, name, rank list  -> as given (torch's own meshes too)

and torch's functional op runs on it: c10d's functional collectives, returning torch's
AsyncCollectiveTensor, traceable by torch.compile as they are in torch (no plait code
between the op and the graph but the group lookup).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as _funcol

from plait.device_mesh import DeviceMesh

AsyncCollectiveTensor = _funcol.AsyncCollectiveTensor
wait_tensor = _funcol.wait_tensor


def resolve_group(group: Any) -> Any:
    """A plait mesh (1-D) or (mesh, axis) as its ProcessGroup; anything else unchanged."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise AssertionError(f"Only 1D mesh is supported, pass in (DeviceMesh, int) together if mesh > 1D "
                                 f"(this one is {group.ndim}-D, axes {group.mesh_dim_names})")
        return group.get_group(0)
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    return group


def broadcast(self: torch.Tensor, src: int, group: Any, tag: str = "") -> torch.Tensor:
    return _funcol.broadcast(self, src, resolve_group(group), tag)


def all_reduce(self: torch.Tensor, reduceOp: str, group: Any, tag: str = "") -> torch.Tensor:  # noqa: N803 - torch's name
    return _funcol.all_reduce(self, reduceOp, resolve_group(group), tag)


def all_gather_tensor(self: torch.Tensor, gather_dim: int, group: Any, tag: str = "") -> torch.Tensor:
    return _funcol.all_gather_tensor(self, gather_dim, resolve_group(group), tag)


def all_gather_tensor_autograd(self: torch.Tensor, gather_dim: int, group: Any, tag: str = "") -> torch.Tensor:
    return _funcol.all_gather_tensor_autograd(self, gather_dim, resolve_group(group), tag)


def reduce_scatter_tensor(self: torch.Tensor, reduceOp: str, scatter_dim: int, group: Any,  # noqa: N803
                          tag: str = "") -> torch.Tensor:
    return _funcol.reduce_scatter_tensor(self, reduceOp, scatter_dim, resolve_group(group), tag)


def reduce_scatter_tensor_autograd(self: torch.Tensor, reduceOp: str, scatter_dim: int, group: Any,  # noqa: N803
                                   tag: str = "") -> torch.Tensor:
    return _funcol.reduce_scatter_tensor_autograd(self, reduceOp, scatter_dim, resolve_group(group), tag)


def all_reduce_coalesced(self: list[torch.Tensor], reduceOp: str, group: Any,  # noqa: N803
                         tag: str = "") -> list[torch.Tensor]:
    return _funcol.all_reduce_coalesced(self, reduceOp, resolve_group(group), tag)


def all_gather_into_tensor_coalesced(self: list[torch.Tensor], group: Any, tag: str = "") -> list[torch.Tensor]:
    return _funcol.all_gather_into_tensor_coalesced(self, resolve_group(group), tag)


def reduce_scatter_tensor_coalesced(inputs: list[torch.Tensor], reduceOp: str, scatter_dim: list[int],  # noqa: N803
                                    group: Any, tag: str = "") -> list[torch.Tensor]:
    return _funcol.reduce_scatter_tensor_coalesced(inputs, reduceOp, scatter_dim, resolve_group(group), tag)


def all_to_all_single(self: torch.Tensor, output_split_sizes: list[int] | None,
                      input_split_sizes: list[int] | None, group: Any, tag: str = "") -> torch.Tensor:
    return _funcol.all_to_all_single(self, output_split_sizes, input_split_sizes, resolve_group(group), tag)


def all_to_all_single_autograd(self: torch.Tensor, output_split_sizes: list[int] | None,
                               input_split_sizes: list[int] | None, group: Any, tag: str = "") -> torch.Tensor:
    return _funcol.all_to_all_single_autograd(self, output_split_sizes, input_split_sizes, resolve_group(group), tag)


def permute_tensor(self: torch.Tensor, src_dst: list[int], group: Any, tag: str = "") -> torch.Tensor:
    return _funcol.permute_tensor(self, src_dst, resolve_group(group), tag)


__all__ = ["AsyncCollectiveTensor", "all_gather_into_tensor_coalesced", "all_gather_tensor",
           "all_gather_tensor_autograd", "all_reduce", "all_reduce_coalesced", "all_to_all_single",
           "all_to_all_single_autograd", "broadcast", "permute_tensor", "reduce_scatter_tensor",
           "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_coalesced", "resolve_group", "wait_tensor"]
