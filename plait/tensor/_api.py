"""plait.tensor._api — torch's module path for the DTensor API's private helpers
(torch.distributed.tensor._api): `_shard_tensor`, and the public names of plait.tensor.api."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.device_mesh import DeviceMesh, _current_mesh
from plait.tensor.api import distribute_module, distribute_tensor
from plait.tensor.dtensor import DTensor
from plait.tensor.placement import Shard


def _shard_tensor(full_tensor: torch.Tensor, placements: Sequence[Shard],
                  device_mesh: DeviceMesh | None = None) -> DTensor:
    """Every rank cuts its own piece of `full_tensor` (the same on every rank: not checked),
    with no communication: distribute_tensor with src_data_rank=None. The mesh defaults to
    the one of the innermost `with mesh:` block."""
    mesh = device_mesh if device_mesh is not None else _current_mesh()
    return distribute_tensor(full_tensor, mesh, placements, src_data_rank=None)


__all__ = ["DTensor", "_shard_tensor", "distribute_module", "distribute_tensor"]
