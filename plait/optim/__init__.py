"""torch.distributed.optim under the porting rule: `ZeroRedundancyOptimizer` (ZeRO-1 over a process
group) and `PostLocalSGDOptimizer` (local SGD with periodic model averaging)."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ZeroRedundancyOptimizer": "plait.optim.zero_redundancy_optimizer",
    "PostLocalSGDOptimizer": "plait.optim.post_localSGD_optimizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'plait.optim' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
