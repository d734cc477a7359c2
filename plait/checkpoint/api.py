"""torch.distributed.checkpoint.api: the module path of `CheckpointException`
(plait.checkpoint.storage_api's)."""

from plait.checkpoint.storage_api import CheckpointException

__all__ = ["CheckpointException"]
