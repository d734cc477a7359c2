"""torch's ddp_comm_hooks.powerSGD_hook (implemented in plait.ddp.comm_hooks.powerSGD_hook)."""

from plait.ddp.comm_hooks.powerSGD_hook import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]
