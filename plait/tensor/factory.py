"""DTensor factories, torch's names: zeros, ones, empty, full, rand, randn.

    zeros(*size, device_mesh=mesh, placements=[Shard(0)])
        -> each rank allocates only its piece (no communication)
    rand / randn: each rank draws the whole tensor and keeps its piece, so the result
        equals the single-process draw (see plait.tensor.ops.random_ops)

A Partial placement makes no sense for a fresh tensor's value and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.device_mesh import DeviceMesh
from plait.tensor.dtensor import DTensor
from plait.tensor.ops.random_ops import sync_generator
from plait.tensor.placement import Partial, Placement, Replicate, contiguous_strides, normalize
from plait.tensor.spec import DTensorSpec


def _spec(size, dtype, device_mesh, placements) -> DTensorSpec:
    if device_mesh is None:
        raise ValueError("DTensor factories need a device_mesh")
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = tuple(size[0])
    size = tuple(int(s) for s in size)
    placements = normalize(placements or [Replicate()] * device_mesh.ndim, len(size), device_mesh.ndim)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"a new DTensor cannot be Partial (placements {list(placements)})")
    return DTensorSpec(device_mesh, placements, size, contiguous_strides(size),
                       dtype or torch.get_default_dtype())


def _make(fill, size, requires_grad, dtype, device_mesh, placements) -> DTensor:
    spec = _spec(size, dtype, device_mesh, placements)
    local = fill(spec)
    return DTensor(local, spec, requires_grad=requires_grad)


def _device(spec: DTensorSpec) -> str:
    return spec.mesh.device_type


def zeros(*size, requires_grad: bool = False, dtype: torch.dtype | None = None,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    return _make(lambda s: torch.zeros(s.local_shape, dtype=s.dtype, device=_device(s)),
                 size, requires_grad, dtype, device_mesh, placements)


def ones(*size, requires_grad: bool = False, dtype: torch.dtype | None = None,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    return _make(lambda s: torch.ones(s.local_shape, dtype=s.dtype, device=_device(s)),
                 size, requires_grad, dtype, device_mesh, placements)


def empty(*size, requires_grad: bool = False, dtype: torch.dtype | None = None,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    return _make(lambda s: torch.empty(s.local_shape, dtype=s.dtype, device=_device(s)),
                 size, requires_grad, dtype, device_mesh, placements)


def full(size, fill_value, *, requires_grad: bool = False, dtype: torch.dtype | None = None,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    return _make(lambda s: torch.full(s.local_shape, fill_value, dtype=s.dtype, device=_device(s)),
                 (size,), requires_grad, dtype, device_mesh, placements)


def _drawn(draw):
    def fill(spec: DTensorSpec) -> torch.Tensor:
        sync_generator(spec.mesh, torch.device(_device(spec)))
        whole = draw(tuple(spec.shape), dtype=spec.dtype, device=_device(spec))
        piece = whole
        for d, (start, size) in enumerate(zip(spec.local_offset, spec.local_shape)):
            piece = piece.narrow(d, start, size)
        return piece.clone() if piece.numel() != whole.numel() else piece

    return fill


def rand(*size, requires_grad: bool = False, dtype: torch.dtype | None = None,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    return _make(_drawn(torch.rand), size, requires_grad, dtype, device_mesh, placements)


def randn(*size, requires_grad: bool = False, dtype: torch.dtype | None = None,
          device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    return _make(_drawn(torch.randn), size, requires_grad, dtype, device_mesh, placements)


__all__ = ["empty", "full", "ones", "rand", "randn", "zeros"]
