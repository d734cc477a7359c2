"""torch.distributed.algorithms._checkpoint (implemented in plait.activation_checkpointing)."""
