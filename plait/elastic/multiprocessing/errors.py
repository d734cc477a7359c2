"""torch.distributed.elastic.multiprocessing.errors: `record`, `ChildFailedError`, `ProcessFailure`
(implemented in plait.run.errors and plait.run.child_failure, torch-free like the launcher)."""

from plait.run.child_failure import ChildFailedError, ProcessFailure
from plait.run.errors import record

__all__ = ["ChildFailedError", "ProcessFailure", "record"]
