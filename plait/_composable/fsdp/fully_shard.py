"""torch.distributed._composable.fsdp.fully_shard: the FSDP2 entry point's old module path
(plait.fsdp's objects)."""

from plait.fsdp.fully_shard import fully_shard
from plait.fsdp.module import FSDPModule, UnshardHandle, register_fsdp_forward_method

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]
