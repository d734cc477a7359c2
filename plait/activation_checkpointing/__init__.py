"""plait.activation_checkpointing — keep a block's inputs, recompute the rest in backward.

Two front doors onto torch.utils.checkpoint, one concept:

    wrapper.py     checkpoint_wrapper(block) -> CheckpointWrapper(block); apply_activation_checkpointing
                   (torch.distributed.algorithms._checkpoint.checkpoint_wrapper; twin:
                   plait.algorithms._checkpoint.checkpoint_wrapper)
    composable.py  checkpoint(block) -> block itself, through forward hooks
                   (torch.distributed._composable.checkpoint; twin: plait._composable)

Invariant, both: only what autograd saves changes — the numbers, the fqns, the state dict and
the optimizer's names are the plain model's. Order with the other strategies (docs/DESIGN.md):
tensor parallel, then activation checkpointing, then compile, then FSDP.
"""

from plait.activation_checkpointing.composable import checkpoint
from plait.activation_checkpointing.wrapper import (
    ActivationWrapper,
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)

__all__ = [
    "ActivationWrapper", "CheckpointImpl", "CheckpointWrapper", "OffloadWrapper",
    "apply_activation_checkpointing", "checkpoint", "checkpoint_wrapper", "offload_wrapper",
]
