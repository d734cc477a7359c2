"""torch.distributed.algorithms.model_averaging (implemented in plait.ddp.model_averaging)."""
