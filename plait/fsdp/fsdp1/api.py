"""The options FullyShardedDataParallel takes: torch's enums and dataclasses
(torch.distributed.fsdp.api), by name, fields and defaults, and what each means on
plait's engine (plait.fsdp.fully_shard's ParamGroup/FSDPState).

    ShardingStrategy.FULL_SHARD      mesh (N,):   reshard after forward (the root keeps its
                                                  parameters for backward, as torch's does)
    ShardingStrategy.SHARD_GRAD_OP   mesh (N,):   keep the gathered parameters until backward
    ShardingStrategy.NO_SHARD        mesh (N, 1): replicate over N, "shard" over 1: every rank
                                                  holds everything, gradients all-reduced
    ShardingStrategy.HYBRID_SHARD    mesh (R, S): shard within S, replicate across R;
                     _HYBRID_SHARD_ZERO2          ... keeping the gathered parameters
    MixedPrecision(param_dtype, reduce_dtype)     -> MixedPrecisionPolicy; buffer_dtype casts
                                                  floating buffers (state dicts keep theirs)
    CPUOffload(offload_params=True)               -> CPUOffloadPolicy
    BackwardPrefetch.BACKWARD_PRE / _POST / None  -> prefetch when a unit's backward starts /
                                                  once its gradients are reduced / never
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch.nn.modules.batchnorm import _BatchNorm


class ShardingStrategy(Enum):
    FULL_SHARD = auto()
    SHARD_GRAD_OP = auto()
    NO_SHARD = auto()
    HYBRID_SHARD = auto()
    _HYBRID_SHARD_ZERO2 = auto()


HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


class BackwardPrefetch(Enum):
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()


@dataclass
class MixedPrecision:
    """Compute in param_dtype, reduce gradients in reduce_dtype (default: param_dtype), keep
    floating buffers in buffer_dtype; the sharded parameters keep their own dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[type[torch.nn.Module]] = (_BatchNorm,)


@dataclass
class CPUOffload:
    offload_params: bool = False


class StateDictType(Enum):
    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


@dataclass
class StateDictConfig:
    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    _use_dtensor: bool = False  # plait's sharded values are always DTensors


@dataclass
class OptimStateDictConfig:
    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


def check_mixed_precision(mp: MixedPrecision | None, where: str) -> None:
    """Every dtype a MixedPrecision names must be a floating dtype."""
    if mp is None:
        return
    if not isinstance(mp, MixedPrecision):
        raise TypeError(f"{where}: mixed_precision must be a MixedPrecision, got {type(mp).__name__}")
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        dtype = getattr(mp, field)
        if dtype is None:
            continue
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"{where}: MixedPrecision({field}={dtype!r}) must be a floating dtype (e.g. "
                            "torch.bfloat16); integer buffers keep their dtype, only floating tensors "
                            "are cast")


__all__ = [
    "BackwardPrefetch", "CPUOffload", "FullOptimStateDictConfig", "FullStateDictConfig",
    "LocalOptimStateDictConfig", "LocalStateDictConfig", "MixedPrecision", "OptimStateDictConfig",
    "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy", "StateDictConfig",
    "StateDictSettings", "StateDictType",
]
