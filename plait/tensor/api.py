"""distribute_tensor and distribute_module: plain tensors and modules onto a mesh.

    distribute_tensor(t, mesh, placements, *, src_data_rank=0)
        per mesh axis in order:  Shard -> coordinate src scatters the pieces (an all-to-all
        in which only src sends); Replicate -> src broadcasts; Partial -> src broadcasts,
        then coordinate 0 keeps the value and the others hold zeros (avg/max/min: all keep)
        src_data_rank=None, or a meta tensor: no communication, every rank cuts its own tensor
    distribute_module(module, mesh, partition_fn, input_fn, output_fn)
        partition_fn(name, submodule, mesh) per submodule, then every parameter and buffer
        still plain is replicated; input_fn / output_fn become forward (pre-)hooks

As in a single-process program, the source rank's tensor is the truth, and the result
never shares memory with the tensor it came from.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import nn

from plait import comm
from plait.device_mesh import DeviceMesh, _current_mesh
from plait.tensor import redistribute as redist
from plait.tensor import strided
from plait.tensor.dtensor import DTensor
from plait.tensor.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
    chunk_offset,
    chunk_sizes,
    interleaved,
    normalize,
)
from plait.tensor.spec import DTensorSpec, same_mesh


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Distribute `tensor` (group rank `src_data_rank`'s on every mesh axis) over the mesh."""
    if device_mesh is None:
        device_mesh = _current_mesh()  # torch's: the innermost `with mesh:` block's
    placements = normalize(placements or [Replicate()] * device_mesh.ndim, tensor.dim(), device_mesh.ndim)
    if isinstance(tensor, DTensor):
        if same_mesh(tensor.device_mesh, device_mesh) and tensor.placements == placements:
            return tensor
        raise ValueError(f"distribute_tensor got a DTensor with placements {tensor.placements} on "
                         f"{tensor.device_mesh}; use redistribute to move it to {placements}")
    coordinate = device_mesh.get_coordinate()
    if src_data_rank is not None and not all(0 <= src_data_rank < n for n in device_mesh.shape):
        raise ValueError(f"src_data_rank {src_data_rank} is not a coordinate on every axis of a mesh "
                         f"of shape {device_mesh.shape}")
    requires_grad = tensor.requires_grad
    source = tensor.detach()
    if source.is_meta:
        src_data_rank = None  # no data to send: every rank cuts its own meta piece (torch's)
    elif source.device.type != device_mesh.device_type:
        source = source.to(device_mesh.device_type)
    spec = DTensorSpec(device_mesh, placements, tuple(tensor.shape),
                       tuple(tensor.stride()) if tensor.is_contiguous() else _contiguous(tensor.shape),
                       tensor.dtype)
    if coordinate is None:  # a rank outside the mesh holds an empty piece and sends nothing
        return DTensor(source.new_empty(0), spec, requires_grad=requires_grad)
    local = source
    # a _StridedShard axis cuts its dim last (placement.shard_order): scatter the others,
    # keep that axis whole, then cut the local piece by it (no communication)
    for axis, p in enumerate(strided.unstrided(placements)):
        n = device_mesh.size(axis)
        group = device_mesh.get_group(axis)
        if type(p) is Shard:
            if src_data_rank is None or n == 1:
                size, start = chunk_offset(local.size(p.dim), n, coordinate[axis])
                local = local.narrow(p.dim, start, size)
            else:
                local = _scatter(local, p.dim, group, n, coordinate[axis], src_data_rank)
        else:
            if src_data_rank is not None and n > 1:
                local = comm.broadcast(local.contiguous().clone(), src=src_data_rank, group=group)
            if isinstance(p, Partial) and p.reduce_op == "sum" and coordinate[axis] != 0:
                local = torch.zeros_like(local)
    blocks = interleaved(placements, device_mesh.shape)
    for axis, p in enumerate(placements):
        if type(p) is _StridedShard:
            sf, n = blocks.get(axis, 1), device_mesh.size(axis)
            sizes = tuple(sf * c for c in chunk_sizes(local.size(p.dim) // sf, n))
            local = redist._chunk(local, redist.Step("chunk", axis, p.dim, sizes, blocks=sf), coordinate)
    if not local.is_meta and local.numel() and \
            local.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        local = local.clone()
    local = local.contiguous()
    return DTensor(local, spec, requires_grad=requires_grad)


def _contiguous(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


def _scatter(x: torch.Tensor, dim: int, group, n: int, me: int, src: int) -> torch.Tensor:
    """Group rank `src` sends rank r its piece r of `x` along `dim` (torch.chunk sizes)."""
    sizes = chunk_sizes(x.size(dim), n)
    shape = list(x.shape)
    shape[dim] = sizes[me]
    mine = math.prod(shape)
    if me == src:
        pieces = x.split(sizes, dim=dim)
        send = torch.cat([piece.reshape(-1) for piece in pieces])
        in_splits = [piece.numel() for piece in pieces]
    else:
        send = x.new_empty(0)
        in_splits = [0] * n
    out_splits = [mine if r == src else 0 for r in range(n)]
    recv = comm.all_to_all(send, group=group, output_split_sizes=out_splits, input_split_sizes=in_splits)
    return recv.view(shape)


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
    input_fn: Callable | None = None,
    output_fn: Callable | None = None,
) -> nn.Module:
    """Distribute `module`'s parameters and buffers and install input/output hooks."""
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError("distribute_module was already applied to this module; apply it once")
    if device_mesh is None:
        device_mesh = _current_mesh()
    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, device_mesh)
        _replicate_rest(submodule, device_mesh)
    if input_fn is not None:
        on_input = _hook_fn(input_fn, "input_fn", "inputs")
        module.register_forward_pre_hook(lambda mod, inputs: on_input(mod, inputs, device_mesh))
    if output_fn is not None:
        on_output = _hook_fn(output_fn, "output_fn", "outputs")
        module.register_forward_hook(lambda mod, inputs, outputs: on_output(mod, outputs, device_mesh))
    module._distribute_module_applied = True
    return module


def _replicate_rest(module: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate the module's own parameters and buffers that are not DTensors yet."""
    replicate = [Replicate()] * mesh.ndim
    for key, param in list(module._parameters.items()):
        if param is not None and not isinstance(param, DTensor):
            dt = distribute_tensor(param.detach(), mesh, replicate)
            module.register_parameter(key, nn.Parameter(dt, requires_grad=param.requires_grad))
    for key, buffer in list(module._buffers.items()):
        if buffer is not None and not isinstance(buffer, DTensor):
            module._buffers[key] = distribute_tensor(buffer, mesh, replicate)


def _hook_fn(fn: Callable, what: str, value: str) -> Callable:
    n_args = len(inspect.signature(fn).parameters)
    if n_args == 3:
        return fn
    if n_args == 2:
        # torch's text, word for word ("inputs" for output_fn too): tests match it
        warnings.warn(f"Deprecating {what} that takes two arguments (inputs, device_mesh), please use "
                      f"{what} that takes in (module, inputs, device_mesh) instead!", FutureWarning, stacklevel=3)
        return lambda mod, x, mesh: fn(x, mesh)
    raise ValueError(f"{what} takes {n_args} arguments; it must take (module, {value}, device_mesh)")


__all__ = ["distribute_module", "distribute_tensor"]
