"""torch.distributed._composable.checkpoint_activation (implemented in
plait.activation_checkpointing.composable)."""

from plait.activation_checkpointing.composable import checkpoint

__all__ = ["checkpoint"]
