"""plait.tensor — DTensor: a tensor spread over a DeviceMesh that inserts its own collectives.

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    w = distribute_tensor(weight, mesh, [Replicate(), Shard(0)])     # rank 0's tensor is the truth
    y = x @ w.t()                      # sharding rules pick placements, comm moves inputs
    y.redistribute(mesh, [Replicate(), Replicate()]).to_local()      # or y.full_tensor()

Data flow of one op (see dispatch.py): DTensor args -> their specs -> cached plan (the op's
rule in ops/, chosen by cost) -> redistribute the inputs that need it (plait.comm) -> run
the op on local tensors -> wrap the outputs with the planned specs. Layers: placement ->
spec -> redistribute -> dtensor -> ops -> dispatch -> api. Tensor parallel on top: plait.tensor.parallel.
"""

from plait.device_mesh import DeviceMesh, init_device_mesh
from plait.tensor.api import distribute_module, distribute_tensor
from plait.tensor.dtensor import DTensor
from plait.tensor.factory import empty, full, ones, rand, randn, zeros
from plait.tensor.ops import register_sharding
from plait.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard
from plait.tensor.spec import DTensorSpec

__all__ = [
    "DTensor", "DTensorSpec", "DeviceMesh", "Partial", "Placement", "Replicate", "Shard",
    "distribute_module", "distribute_tensor", "empty", "full", "init_device_mesh", "ones", "rand",
    "randn", "register_sharding", "zeros", "_StridedShard",
]
