"""FullyShardedDataParallel (torch's FSDP1 wrapper API) over the fully_shard engine:
api (enums, configs), init (mesh, meta init, sync_module_states), wrapper (the class),
state_dict (state-dict types, optimizer state, summon_full_params)."""

from plait.fsdp.fsdp1.api import *  # noqa: F403
from plait.fsdp.fsdp1.api import __all__ as _api_all
from plait.fsdp.fsdp1.rekey import OptimStateKeyType
from plait.fsdp.fsdp1.wrapper import FullyShardedDataParallel

__all__ = [*_api_all, "FullyShardedDataParallel", "OptimStateKeyType"]
