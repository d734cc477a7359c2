"""torch's model_averaging.averagers (implemented in plait.ddp.model_averaging)."""

from plait.ddp.model_averaging import ModelAverager, PeriodicModelAverager

__all__ = ["ModelAverager", "PeriodicModelAverager"]
