"""The policies `fully_shard` takes: torch's `MixedPrecisionPolicy`, `OffloadPolicy` and
`CPUOffloadPolicy`, by name, fields and defaults.

    MixedPrecisionPolicy(param_dtype)    all-gather and compute in param_dtype; the sharded
                                         parameters (what the optimizer steps) keep theirs
    MixedPrecisionPolicy(reduce_dtype)   gradients reduce-scatter in reduce_dtype (default:
                                         param_dtype), then land in the sharded .grad in
                                         the parameter's own dtype
    CPUOffloadPolicy(pin_memory=True)    sharded parameters, gradients and optimizer state
                                         on the CPU; only unsharded parameters on the device
    DataParallelMeshDims(shard="fsdp", replicate="dp_replicate")
                                         which axes of a full SPMD mesh are data parallel
                                         (a tuple of names: those axes taken as one)

torch's `torch.distributed.fsdp.api` also holds FSDP1's enums and state-dict configs; they
are plait.fsdp.fsdp1's, re-exported at the bottom so that path imports them too.
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
class DataParallelMeshDims:
    """The data-parallel axes of a full SPMD mesh, by name: `shard` the axis (or axes, taken as
    one) FSDP shards over, `replicate` the HSDP replicate axis (or axes). At least one is set."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(axes: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclass
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded state on the CPU. `pin_memory` pins it (only where a CUDA device
    exists to copy to; on a CPU-only machine there is nothing to pin for)."""

    pin_memory: bool = True


# FSDP1's names on torch's path (plait.fsdp.fsdp1.api imports nothing of this module)
from plait.fsdp.fsdp1.api import (  # noqa: E402
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

__all__ = ["BackwardPrefetch", "CPUOffload", "CPUOffloadPolicy", "DataParallelMeshDims", "FullOptimStateDictConfig",
           "FullStateDictConfig", "LocalOptimStateDictConfig", "LocalStateDictConfig", "MixedPrecision",
           "MixedPrecisionPolicy", "OffloadPolicy", "OptimStateDictConfig", "ShardedOptimStateDictConfig",
           "ShardedStateDictConfig", "ShardingStrategy", "StateDictConfig", "StateDictSettings", "StateDictType"]
