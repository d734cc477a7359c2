"""torch.distributed._composable: `replicate` (plait.ddp) and the composable `checkpoint`
(plait.checkpoint_activation), both applied to a module in place, names unchanged."""

from plait._composable.replicate import replicate  # the function; the module stays importable
from plait.checkpoint_activation import checkpoint

__all__ = ["checkpoint", "replicate"]
