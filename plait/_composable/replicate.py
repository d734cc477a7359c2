"""plait._composable.replicate — torch's module path for composable DDP
(`from torch.distributed._composable.replicate import replicate`): plait.ddp's replicate."""

from plait.ddp import replicate

__all__ = ["replicate"]
