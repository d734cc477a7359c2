"""torch.distributed.algorithms.join: `Join`, `Joinable`, `JoinHook` (implemented in plait.ddp.join)."""

from plait.ddp.join import Join, Joinable, JoinHook

__all__ = ["Join", "JoinHook", "Joinable"]
