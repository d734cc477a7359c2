"""Foreach ops over DTensors on different meshes run one call per mesh (what AdamW's
foreach path meets under FSDP over TP: parameters on the (dp, tp) mesh and on mesh["dp"]);
results equal the same ops applied element by element. Other ops still refuse mixed
meshes. Lists that hold plain tensors at some indices run those as plain tensors; a plain
tensor beside a DTensor at one index is refused before anything is written."""

import pytest
import torch

from plait.device_mesh import init_device_mesh
from plait.tensor import DTensor, Replicate, Shard, distribute_tensor
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


@distributed([2])
def test_foreach_over_dtensors_and_plain_tensors_equals_elementwise():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = [torch.randn(6, 4), torch.randn(5), torch.randn(3)]
    params = [distribute_tensor(full[0], mesh, [Shard(0)]), full[1].clone(), distribute_tensor(full[2], mesh, [Replicate()])]
    grads = [distribute_tensor(full[0] + 1, mesh, [Shard(0)]), full[1] + 1, distribute_tensor(full[2] + 1, mesh, [Replicate()])]
    torch._foreach_mul_(params, [0.9, 0.8, 0.7])  # a scalar list is cut at the same indices
    torch._foreach_addcmul_(params, grads, grads, value=0.1)
    out = torch._foreach_sqrt(torch._foreach_abs(params))
    for p, o, t, s in zip(params, out, full, (0.9, 0.8, 0.7)):
        want = t * s + 0.1 * (t + 1) ** 2
        got_p, got_o = (x.full_tensor() if isinstance(x, DTensor) else x for x in (p, o))
        assert type(o) is type(p)
        torch.testing.assert_close(got_p, want)
        torch.testing.assert_close(got_o, want.abs().sqrt())
    before = params[1].clone()
    with pytest.raises(ValueError, match=r"shape \(3,\) mixed with DTensors"):
        torch._foreach_add_(params, [grads[0], grads[1], torch.ones(3)])  # index 2: a DTensor and a plain tensor
    torch.testing.assert_close(params[1], before, atol=0, rtol=0)  # the plain index was not written
