"""local_map: run a function written for torch.Tensors on the local pieces of DTensors.

    f = local_map(fn, out_placements, in_placements, in_grad_placements, device_mesh,
                  redistribute_inputs=False)
    f(*args, **kwargs):
      flat args (pytree) -> each DTensor: check (or redistribute to) in_placements[i]
        -> to_local(grad_placements=in_grad_placements[i]) -> fn(*local args, **kwargs)
      -> flat outputs -> each tensor: DTensor.from_local(out, mesh, out_placements[j])

torch's semantics: placements are per flattened positional argument and per flattened
output (None for a non-tensor); kwargs pass through untouched; a plain torch.Tensor
argument passes as it is whatever its in_placements entry says; if no argument is a
DTensor, fn runs on the arguments as given and its result is returned unwrapped.
Differentiable: to_local, redistribute and from_local are autograd Functions, so the
gradient of an output flows back to each DTensor input with the input's placements (or
in_grad_placements). No communication happens unless an input is redistributed; what fn
computes on each rank is its business (e.g. an all-reduce for a Partial output).

Where it differs from torch's: a wrong number of placements, or placements given for a
non-tensor, raise ValueError (torch asserts).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from plait.device_mesh import DeviceMesh
from plait.tensor.dtensor import DTensor
from plait.tensor.placement import Placement

PlacementType = Sequence[Placement] | None
InputPlacements = tuple[PlacementType, ...] | None
OutputPlacements = PlacementType | tuple[PlacementType, ...]


def local_map(
    func: Callable | None = None,
    out_placements: OutputPlacements = None,
    in_placements: InputPlacements = None,
    in_grad_placements: InputPlacements = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
):
    """torch.distributed.tensor.experimental.local_map (see the module note); with
    func=None, a decorator."""
    if func is None:
        return functools.partial(local_map, out_placements=out_placements, in_placements=in_placements,
                                 in_grad_placements=in_grad_placements, device_mesh=device_mesh,
                                 redistribute_inputs=redistribute_inputs)
    return functools.partial(_local_map_wrapped, func, out_placements, in_placements, in_grad_placements,
                             device_mesh, redistribute_inputs)


def _local_map_wrapped(func: Callable, out_placements: OutputPlacements, in_placements: InputPlacements,
                       in_grad_placements: InputPlacements, device_mesh: DeviceMesh | None,
                       redistribute_inputs: bool, *args, **kwargs):
    flat_args, args_spec = pytree.tree_flatten(args)
    name = getattr(func, "__name__", repr(func))
    for what, given in (("in_placements", in_placements), ("in_grad_placements", in_grad_placements)):
        if given is not None and len(given) != len(flat_args):
            raise ValueError(f"local_map({name}): {what} has {len(given)} entries for {len(flat_args)} "
                             "flattened positional args; give one per arg (None for a non-tensor)")
    local_args = []
    seen_dtensor = False
    for i, arg in enumerate(flat_args):
        if not isinstance(arg, DTensor):
            if in_placements is not None and not isinstance(arg, torch.Tensor) and in_placements[i] is not None:
                raise ValueError(f"local_map({name}): arg {i} is a {type(arg).__name__}, not a tensor, but "
                                 f"in_placements[{i}] is {in_placements[i]}; give None for it")
            local_args.append(arg)  # a plain tensor passes as it is (torch's rule)
            continue
        seen_dtensor = True
        if device_mesh is None:  # the first DTensor's mesh carries the outputs
            device_mesh = arg.device_mesh
        if in_placements is not None:
            want = _placements(in_placements[i], "in_placements", i, name)
            if arg.placements != want:
                if not redistribute_inputs:
                    raise ValueError(
                        f"local_map({name}): arg {i} has placements {arg.placements} but in_placements[{i}] "
                        f"is {want}; redistribute it first or pass redistribute_inputs=True to local_map")
                arg = arg.redistribute(placements=want)
        if in_grad_placements is not None:
            grads = _placements(in_grad_placements[i], "in_grad_placements", i, name)
            local_args.append(arg.to_local(grad_placements=grads))
        else:
            local_args.append(arg.to_local())
    out = func(*pytree.tree_unflatten(local_args, args_spec), **kwargs)
    if not seen_dtensor:
        return out  # nothing ran on DTensors: out_placements do not apply (torch's rule)
    flat_out, out_spec = pytree.tree_flatten(out)
    per_out = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(per_out) != len(flat_out):
        raise ValueError(f"local_map({name}): {len(per_out)} out_placements for {len(flat_out)} flattened "
                         "outputs; give one per output (None for a non-tensor), as a tuple when several")
    wrapped = []
    for j, (o, placements) in enumerate(zip(flat_out, per_out)):
        if isinstance(o, DTensor):
            raise TypeError(f"local_map({name}): output {j} is a DTensor; the function must return "
                            "plain tensors (local pieces)")
        if isinstance(o, torch.Tensor):
            wrapped.append(DTensor.from_local(o, device_mesh, placements, run_check=False))
        else:
            if placements is not None:
                raise ValueError(f"local_map({name}): output {j} is a {type(o).__name__}, not a tensor, "
                                 f"but out_placements[{j}] is {placements}; give None for it")
            wrapped.append(o)
    return pytree.tree_unflatten(wrapped, out_spec)


def _placements(given: PlacementType, what: str, i: int, name: str) -> tuple[Placement, ...]:
    if given is None:
        raise ValueError(f"local_map({name}): arg {i} is a DTensor but {what}[{i}] is None; "
                         "give its placements")
    return tuple(given)


__all__ = ["local_map"]
