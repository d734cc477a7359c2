"""torch.distributed.algorithms.ddp_comm_hooks (implemented in plait.ddp.comm_hooks)."""

from plait.algorithms.ddp_comm_hooks import (
    ddp_zero_hook,
    default_hooks,
    post_localSGD_hook,
    powerSGD_hook,
)

__all__ = ["ddp_zero_hook", "default_hooks", "post_localSGD_hook", "powerSGD_hook"]
