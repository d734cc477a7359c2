"""plait — every way to scale one PyTorch training script from one device to many.

Layers (each imports only those below it): comm -> device_mesh -> tensor -> strategies
(ddp, fsdp, tensor.parallel, pipelining) -> checkpoint, run -> train, cli. See DESIGN.md.
"""

from plait import comm
from plait.device_mesh import DeviceMesh, init_device_mesh

__version__ = "0.1.0"

__all__ = ["DeviceMesh", "comm", "init_device_mesh"]
