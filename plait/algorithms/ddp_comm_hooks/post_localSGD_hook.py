"""torch's ddp_comm_hooks.post_localSGD_hook (implemented in plait.ddp.comm_hooks.post_localSGD_hook)."""

from plait.ddp.comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]
