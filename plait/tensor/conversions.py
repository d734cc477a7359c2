"""The conversions between DTensors and plain tensors, and between placements, as
autograd Functions whose backward is the reverse move:

    from_local    local -> DTensor       grad: DTensor -> forward placements (Partial ->
                                         Replicate) or grad_placements -> its local
    to_local      DTensor -> local       grad: local -> DTensor with the forward placements
    redistribute  src -> dst             grad: whatever placements it arrives in -> src,
                                         Partial -> Replicate (the grad of a sum is shared)

A gradient with respect to a Partial value is the same on every rank, hence Replicate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.tensor import redistribute as redist
from plait.tensor import traced
from plait.tensor.dtensor import DTensor, wrap
from plait.tensor.placement import Partial, Placement, Replicate
from plait.tensor.spec import DTensorSpec


def redistribute_local(x: DTensor, placements: tuple[Placement, ...], *, async_op: bool = False,
                       copy: bool = False):
    """`x`'s local tensor moved to `placements`, without autograd. `copy` guarantees the
    result shares no memory with `x` when the placements change (a user-facing result
    must not alias a tensor with another layout)."""
    spec = x._spec
    local = x._local_tensor
    if spec.mesh._coordinate is None:
        return local  # outside the mesh: an empty piece that takes part in no collective
    steps = redist.plan_for(spec, placements)
    out = redist.run(local, steps, spec.mesh, async_op=async_op)
    if copy and steps and isinstance(out, torch.Tensor) and _aliases(out, local):
        out = out.clone()
    return out


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    if traced.is_traced(a):
        return a is b  # a graph has no storage to compare; functional ops never alias anyway
    return a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def grad_placements_for(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """A gradient with respect to a Partial value is the same on every rank: Replicate."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


class FromLocal(torch.autograd.Function):
    """Wrap in forward; in backward, move the grad to the forward's placements
    (Partial -> Replicate) or `grad_placements`, then unwrap."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, grads: tuple[Placement, ...] | None):
        ctx.placements = grads or grad_placements_for(spec.placements)
        return DTensor(local.detach(), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if grad.placements != ctx.placements:
            return redistribute_local(grad, ctx.placements), None, None
        return grad._local_tensor, None, None


class ToLocal(torch.autograd.Function):
    """Unwrap in forward; wrap the grad with the forward's placements in backward."""

    @staticmethod
    def forward(ctx, x: DTensor, grads: tuple[Placement, ...] | None):
        ctx.spec = x._spec if grads is None else x._spec.with_placements(grads)
        local = x._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        if tuple(grad.shape) != spec.local_shape:
            raise ValueError(f"to_local's gradient has shape {tuple(grad.shape)} but the local tensor "
                             f"had {spec.local_shape}")
        if grad.dtype != spec.dtype:
            grad = grad.to(spec.dtype)
        return wrap(grad, DTensorSpec(spec.mesh, spec.placements, spec.shape, spec.stride, grad.dtype)), None


class Redistribute(torch.autograd.Function):
    """src -> dst in forward; the grad goes dst-side -> src (Partial -> Replicate) in backward."""

    @staticmethod
    def forward(ctx, x: DTensor, placements, async_op, forward_dtype, backward_dtype):
        spec = x._spec
        ctx.src, ctx.dtype, ctx.backward_dtype = spec, spec.dtype, backward_dtype
        if forward_dtype is not None and forward_dtype != spec.dtype:
            x = wrap(x._local_tensor.to(forward_dtype),
                     DTensorSpec(spec.mesh, spec.placements, spec.shape, spec.stride, forward_dtype))
            spec = x._spec
        if placements == spec.placements:
            return wrap(x._local_tensor, spec)
        out_spec = spec.with_placements(placements)
        local = redistribute_local(x, placements, async_op=async_op, copy=True)
        if isinstance(local, redist.Pending):
            r = wrap(x._local, out_spec)  # placeholder; the property resolves the wait
            r._pending = local
            return r
        return wrap(local, out_spec)

    @staticmethod
    def backward(ctx, grad: DTensor):
        src = ctx.src
        target = grad_placements_for(src.placements)
        if ctx.backward_dtype is not None and grad.dtype != ctx.backward_dtype:
            grad = _cast(grad, ctx.backward_dtype)
        if grad.placements != target:
            g = grad._spec
            grad = wrap(redistribute_local(grad, target), g.with_placements(target))
        if grad.dtype != ctx.dtype:
            grad = _cast(grad, ctx.dtype)
        return grad, None, None, None, None


def _cast(x: DTensor, dtype: torch.dtype) -> DTensor:
    s = x._spec
    return wrap(x._local_tensor.to(dtype), DTensorSpec(s.mesh, s.placements, s.shape, s.stride, dtype))


__all__ = ["FromLocal", "Redistribute", "ToLocal", "grad_placements_for", "redistribute_local"]
