"""torch.distributed.tensor._random: seeding DTensor's random ops (torch's names and meaning).

plait's DTensor random ops draw from the default generator of the local tensor's device: each
rank draws the whole tensor and keeps its piece (plait/tensor/ops/random_ops.py), so every rank
of a mesh must hold the same generator state. The first random op on a mesh broadcasts
coordinate 0's state; these calls set it instead:

    manual_seed(seed, mesh)         torch.manual_seed(seed) on this rank, and the mesh is taken
                                    as in sync (torch's run_state_sync=False: every rank of the
                                    mesh passes the same seed; pipeline stages may pass others)
    OffsetBasedRNGTracker(mesh)     broadcast coordinate 0's state over the mesh now
                                    (run_state_sync=False: take the ranks as seeded alike)

Where torch supports these only on CUDA-like devices (a CPU mesh warns and seeds nothing),
plait's draws are exact on every device, so a CPU mesh is seeded as a GPU one.
"""

from __future__ import annotations

import torch

from plait.device_mesh import DeviceMesh
from plait.tensor.ops.random_ops import mark_synced, sync_generator

_rng_tracker: OffsetBasedRNGTracker | None = None  # torch's module global: set by the calls below


def is_rng_supported_mesh(device_mesh: DeviceMesh) -> bool:
    """Whether DTensor's random ops are exact on this mesh's device: on every device plait
    runs (the whole tensor is drawn, then sliced), where torch's answer is CUDA-like only."""
    return True


def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """Seed this rank's generators with `seed` for DTensor's random ops on `device_mesh`; every
    rank of the mesh must pass the same seed (not checked, as torch does not)."""
    global _rng_tracker
    if device_mesh.get_coordinate() is None:
        raise RuntimeError(
            f"manual_seed requires the current rank (global rank {device_mesh.get_rank()}) to be a part "
            f"of the device mesh {device_mesh.mesh.tolist()}; otherwise its DTensor RNG state is not set"
        )
    if _rng_tracker is None:
        _rng_tracker = OffsetBasedRNGTracker(device_mesh, run_state_sync=False)
    torch.manual_seed(seed)  # the CPU generator and every CUDA device's, as torch's
    mark_synced(device_mesh, device_mesh.device_type)


class OffsetBasedRNGTracker:
    """torch's default DTensor RNG tracker. plait's draws need no offsets (each rank draws the
    whole tensor from the shared state); what remains is the shared state itself: with
    `run_state_sync` every rank of the mesh takes coordinate 0's state now."""

    def __init__(self, device_mesh: DeviceMesh, run_state_sync: bool = True) -> None:
        self._mesh = device_mesh
        self._device = torch.device(device_mesh.device_type)
        if run_state_sync:
            sync_generator(device_mesh, self._device, force=True)
        else:
            mark_synced(device_mesh, self._device.type)

    def _manual_seed(self, parallel_seed: int) -> None:
        manual_seed(parallel_seed, self._mesh)


__all__ = ["OffsetBasedRNGTracker", "is_rng_supported_mesh", "manual_seed"]
