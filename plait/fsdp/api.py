"""The policies `fully_shard` takes: torch's `MixedPrecisionPolicy`, `OffloadPolicy` and
`CPUOffloadPolicy`, by name, fields and defaults.

    MixedPrecisionPolicy(param_dtype)    all-gather and compute in param_dtype; the sharded
                                         parameters (what the optimizer steps) keep theirs
    MixedPrecisionPolicy(reduce_dtype)   gradients reduce-scatter in reduce_dtype (default:
                                         param_dtype), then land in the sharded .grad in
                                         the parameter's own dtype
    CPUOffloadPolicy(pin_memory=True)    sharded parameters, gradients and optimizer state
                                         on the CPU; only unsharded parameters on the device
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision: casts happen at group boundaries, not per op."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded state on the CPU. `pin_memory` pins it (only where a CUDA device
    exists to copy to; on a CPU-only machine there is nothing to pin for)."""

    pin_memory: bool = True


__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]
