"""torch.distributed._composable.fsdp: FSDP2's first home, kept by torch (and imported by
torchtitan) as an alias of torch.distributed.fsdp's FSDP2 names; here, of plait.fsdp's."""

from plait._composable.fsdp.fully_shard import FSDPModule, fully_shard, register_fsdp_forward_method
from plait.fsdp.api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "fully_shard",
           "register_fsdp_forward_method"]
