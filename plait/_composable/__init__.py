"""torch.distributed._composable: `replicate` (plait.ddp) and the composable `checkpoint`
(plait.checkpoint_activation), both applied to a module in place, names unchanged."""

from plait.checkpoint_activation import checkpoint
from plait.ddp import replicate

__all__ = ["checkpoint", "replicate"]
