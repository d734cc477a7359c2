"""torch's ddp_comm_hooks.ddp_zero_hook (implemented in plait.ddp.comm_hooks.ddp_zero_hook)."""

from plait.ddp.comm_hooks.ddp_zero_hook import hook_with_zero_step, hook_with_zero_step_interleaved

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]
