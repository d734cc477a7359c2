"""plait — every way to scale one PyTorch training script from one device to many.

Layers (each imports only those below it): comm -> device_mesh -> tensor -> strategies
(ddp, fsdp, tensor.parallel, pipelining) -> checkpoint, run -> train, cli. See docs/DESIGN.md.

Names are imported on first use, so `plait run` and `plait plan` start without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "comm": "plait.comm",
    "DeviceMesh": "plait.device_mesh",
    "init_device_mesh": "plait.device_mesh",
    "DTensor": "plait.tensor",
    "Shard": "plait.tensor",
    "Replicate": "plait.tensor",
    "Partial": "plait.tensor",
    "distribute_tensor": "plait.tensor",
    "distribute_module": "plait.tensor",
    "DistributedDataParallel": "plait.ddp",
    "replicate": "plait.ddp",
    "fully_shard": "plait.fsdp",
    "FSDPModule": "plait.fsdp",
    "MixedPrecisionPolicy": "plait.fsdp",
    "CPUOffloadPolicy": "plait.fsdp",
    "FullyShardedDataParallel": "plait.fsdp",
    "checkpoint_wrapper": "plait.activation_checkpointing",
    "apply_activation_checkpointing": "plait.activation_checkpointing",
    "parallelize_module": "plait.tensor.parallel",
    "ColwiseParallel": "plait.tensor.parallel",
    "RowwiseParallel": "plait.tensor.parallel",
    "SequenceParallel": "plait.tensor.parallel",
    "PrepareModuleInput": "plait.tensor.parallel",
    "PrepareModuleOutput": "plait.tensor.parallel",
    "loss_parallel": "plait.tensor.parallel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'plait' has no attribute {name!r}")
    value = importlib.import_module(module)
    return value if module.endswith(name) else getattr(value, name)

import plait.debug.activate  # noqa: E402, F401 - PLAIT_DISTRIBUTED_DEBUG/PLAIT_DESYNC_DEBUG act at import
