"""torch.distributed._composable: `replicate` (plait.ddp) and the composable `checkpoint`
(plait.activation_checkpointing), both applied to a module in place, names unchanged."""

from plait._composable.replicate import replicate  # the function; the module stays importable
from plait.activation_checkpointing.composable import checkpoint

__all__ = ["checkpoint", "replicate"]
