"""plait.tensor._redistribute — torch's module path for moving a local tensor between two
specs (torch.distributed.tensor._redistribute.redistribute_local_tensor), over
plait.tensor.redistribute's plan and run."""

from __future__ import annotations

import torch

from plait.tensor import redistribute as redist
from plait.tensor.spec import DTensorSpec, same_mesh


def redistribute_local_tensor(
    local_tensor: torch.Tensor,
    current_spec: DTensorSpec,
    target_spec: DTensorSpec,
    *,
    async_op: bool = False,
    is_backward: bool = False,  # noqa: ARG001 - torch's signature; plait plans both ways alike
    use_graph_based_transform: bool | None = None,  # noqa: ARG001 - torch's signature
) -> torch.Tensor:
    """`local_tensor`, this rank's piece under `current_spec`, as its piece under
    `target_spec` (same mesh, same global shape); a rank outside the mesh gets it back."""
    if not same_mesh(current_spec.mesh, target_spec.mesh):
        raise ValueError(f"redistribute_local_tensor moves within one mesh: {current_spec.mesh} != "
                         f"{target_spec.mesh}")
    if tuple(current_spec.shape) != tuple(target_spec.shape):
        raise ValueError(f"redistribute_local_tensor keeps the global shape: {tuple(current_spec.shape)} "
                         f"!= {tuple(target_spec.shape)}")
    if current_spec.mesh._coordinate is None:
        return local_tensor
    steps = redist.plan_for(current_spec, tuple(target_spec.placements))
    out = redist.run(local_tensor, steps, current_spec.mesh, async_op=async_op)
    return out.wait() if isinstance(out, redist.Pending) else out


__all__ = ["redistribute_local_tensor"]
