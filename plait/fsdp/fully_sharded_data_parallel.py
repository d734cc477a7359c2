"""torch.distributed.fsdp.fully_sharded_data_parallel: the FSDP1 wrapper's module path, which
scripts (torch's DCP recipe among them) import `StateDictType` and the configs from.
plait.fsdp.fsdp1's objects, under torch's module name."""

from plait.fsdp.fsdp1 import FullyShardedDataParallel, OptimStateKeyType
from plait.fsdp.fsdp1.api import (
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

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]  # torch's; the configs are importable too
_REEXPORTED = (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig, LocalOptimStateDictConfig,
               LocalStateDictConfig, MixedPrecision, OptimStateDictConfig, ShardedOptimStateDictConfig,
               ShardedStateDictConfig, ShardingStrategy, StateDictConfig, StateDictSettings, StateDictType)
