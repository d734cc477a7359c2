"""torch.distributed._composable.checkpoint_activation: the composable `checkpoint`'s module
path (plait.checkpoint_activation's)."""

from plait.checkpoint_activation import checkpoint

__all__ = ["checkpoint"]
