"""plait.fsdp — fully sharded data parallel: torch's `fully_shard` (FSDP2), on plait's DTensor.

    for block in model.blocks:
        fully_shard(block)                 # one group per block: one all-gather, one reduce-scatter
    fully_shard(model)                     # the root: what is left (embeddings, head)
    opt = torch.optim.AdamW(model.parameters())   # steps on the Shard(0) DTensors

Invariant: between steps a rank holds only its torch.chunk piece of every parameter
(a Shard(0) DTensor registered under the original name), its gradient and the optimizer
state for it. Data flow per group: sharded params -> one all-gather into a flat buffer ->
unsharded views (autograd leaves) -> forward/backward -> one reduce-scatter of the
gradients (averaged) -> sharded .grad. Files: api (policies), param (one parameter's
forms), group (state machine and collectives), state (hooks and the root), module
(FSDPModule's methods), fully_shard (the entry point).

The second front door, torch's FSDP1 wrapper, drives the same engine:

    model = FullyShardedDataParallel(model, auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}))   # = fully_shard per Block, then root

(fsdp1/: the wrapper, its options, state-dict types; wrap: the auto-wrap policies.)
"""

from plait.fsdp.api import (
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from plait.fsdp.fsdp1 import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from plait.fsdp.fully_shard import fully_shard
from plait.fsdp.module import FSDPModule, UnshardHandle, register_fsdp_forward_method

__all__ = ["BackwardPrefetch", "CPUOffload", "CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "FullOptimStateDictConfig",
           "FullStateDictConfig", "FullyShardedDataParallel", "LocalOptimStateDictConfig", "LocalStateDictConfig",
           "MixedPrecision", "MixedPrecisionPolicy", "OffloadPolicy", "OptimStateDictConfig", "OptimStateKeyType",
           "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy", "StateDictConfig",
           "StateDictSettings", "StateDictType", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]
