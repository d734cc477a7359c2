"""plait.debug — listens at plait.comm's door: counting, tracing, hang diagnosis."""

from plait.debug.comm_mode import CommCounts, CommDebugMode

__all__ = ["CommCounts", "CommDebugMode"]
