"""torch's algorithms._checkpoint.checkpoint_wrapper (implemented in plait.activation_checkpoint)."""

from plait.activation_checkpoint import (
    ActivationWrapper,
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)

__all__ = ["ActivationWrapper", "CheckpointImpl", "CheckpointWrapper", "OffloadWrapper",
           "apply_activation_checkpointing", "checkpoint_wrapper", "offload_wrapper"]
