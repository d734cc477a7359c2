"""plait.tensor.debug — torch's DTensor debugging tools, by name, and the fallback's switch.

    with CommDebugMode() as mode:                 # plait.debug's counter at plait.comm's door
        y = x_dt @ w_dt
    mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce]
    visualize_sharding(x_dt, header="x")          # which rank holds which rows and columns

    with fallback_policy("error"):                # an op with no sharding rule raises, naming it
        loss = model(x).sum()
    fallback_counts()                             # {"aten.cumsum.default": 3, ...} since the reset
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from plait.debug.comm_mode import CommDebugMode
from plait.tensor import fallback as _fallback
from plait.tensor.debug.visualize import visualize_sharding


def fallback_counts() -> dict[str, int]:
    """Calls that went through the replicate-everything fallback, per op, since the last
    `reset_fallback_counts()` (this process only)."""
    return dict(_fallback.counts)


def reset_fallback_counts() -> None:
    _fallback.counts.clear()


def set_fallback_policy(policy: str) -> str:
    """"warn" (default; also PLAIT_DTENSOR_FALLBACK), "error" or "silent"; returns the
    previous policy."""
    return _fallback.set_policy(policy)


@contextlib.contextmanager
def fallback_policy(policy: str) -> Iterator[None]:
    """The fallback policy inside the block (see set_fallback_policy)."""
    previous = _fallback.set_policy(policy)
    try:
        yield
    finally:
        _fallback.set_policy(previous)


__all__ = ["CommDebugMode", "fallback_counts", "fallback_policy", "reset_fallback_counts",
           "set_fallback_policy", "visualize_sharding"]
