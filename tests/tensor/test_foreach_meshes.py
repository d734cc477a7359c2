"""Foreach ops over DTensors on different meshes run one call per mesh (what AdamW's
foreach path meets under FSDP over TP: parameters on the (dp, tp) mesh and on mesh["dp"]);
results equal the same ops applied element by element. Other ops still refuse mixed
meshes."""

import pytest
import torch

from plait.device_mesh import init_device_mesh
from plait.tensor import Replicate, Shard, distribute_tensor
from plait.testing import distributed


@distributed([4])
def test_foreach_over_two_meshes_equals_elementwise():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = [torch.randn(6, 4), torch.randn(5), torch.randn(4, 6)]
    layouts = [(mesh, (Shard(1), Shard(0))), (mesh["dp"], (Shard(0),)), (mesh, (Shard(0), Replicate()))]

    def make(ts):
        return [distribute_tensor(t, m, p) for t, (m, p) in zip(ts, layouts)]

    params, grads = make(full), make([t * 0.5 + 1 for t in full])
    torch._foreach_mul_(params, 0.9)
    torch._foreach_addcmul_(params, grads, grads, value=0.1)
    out = torch._foreach_sqrt(torch._foreach_abs(params))
    for p, o, t in zip(params, out, full):
        want = t * 0.9 + 0.1 * (t * 0.5 + 1) ** 2
        torch.testing.assert_close(p.full_tensor(), want)
        torch.testing.assert_close(o.full_tensor(), want.abs().sqrt())
        assert o.device_mesh == p.device_mesh and o.placements == p.placements
    with pytest.raises(ValueError, match="different meshes"):
        torch.add(params[0][:5, 0], params[1])  # not a foreach op: still refused
