"""torch.distributed.tensor.device_mesh: DTensor's old path to the mesh (plait.device_mesh's)."""

from plait.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
