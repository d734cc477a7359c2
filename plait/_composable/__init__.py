"""torch.distributed._composable: `replicate` (plait.ddp) and the composable `checkpoint`
(plait.activation_checkpointing), both applied to a module in place, names unchanged."""

from plait.activation_checkpointing.composable import checkpoint
from plait.ddp import replicate

__all__ = ["checkpoint", "replicate"]
