"""plait.tensor._utils — torch's module path for the layout helpers libraries call
(torch.distributed.tensor._utils), over plait.tensor.placement's pure functions."""

from __future__ import annotations

from collections.abc import Sequence

from plait.device_mesh import DeviceMesh
from plait.tensor.placement import Placement, local_shape_and_offset, normalize


def compute_local_shape_and_global_offset(
    global_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape and where it starts in the global tensor, per dim; a rank
    outside the mesh gets ((0,), ()), as in torch."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return (0,), ()
    placements = normalize(placements, len(global_shape), mesh.ndim)
    return local_shape_and_offset(tuple(global_shape), placements, mesh.shape, coordinate)


__all__ = ["compute_local_shape_and_global_offset"]
