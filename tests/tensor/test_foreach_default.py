"""An optimizer left at foreach=None treats DTensor parameters as torch does once
torch.distributed.tensor is imported: foreach wherever the device has foreach kernels.

The device rule (CUDA, XPU, ...; never CPU) is torch's; the test moves CPU into the list
so the choice shows on this machine, then checks that one AdamW step over DTensor
parameters runs one `_foreach_*` dispatch per op (not one per parameter) and equals the
loop's step bit for bit on these small integer values (tolerance 0: both paths run the
same per-element float32 arithmetic).
"""

import torch
import torch.optim.optimizer as optimizer_module
from torch import nn

from plait.tensor import DTensor, Shard, distribute_tensor
from plait.testing import distributed

from ._helpers import ints, mesh_for


def _params(mesh) -> list[nn.Parameter]:
    return [nn.Parameter(distribute_tensor(ints(5, 3, seed=i), mesh, [Shard(0)])) for i in range(3)]


@distributed([2])
def test_dtensor_params_default_to_foreach_where_torch_would():
    mesh = mesh_for(2)
    params = _params(mesh)
    assert optimizer_module._default_to_fused_or_foreach(params, differentiable=False) == (False, False), \
        "CPU: the loop, as for plain tensors"
    devices, dispatch = optimizer_module._get_foreach_kernels_supported_devices, DTensor.__dict__["__torch_dispatch__"]
    optimizer_module._get_foreach_kernels_supported_devices = lambda: ["cpu"]
    try:
        _check_foreach_step(mesh, params)
    finally:
        optimizer_module._get_foreach_kernels_supported_devices = devices
        DTensor.__torch_dispatch__ = dispatch


def _check_foreach_step(mesh, params: list[nn.Parameter]) -> None:
    assert optimizer_module._default_to_fused_or_foreach(params, differentiable=False) == (False, True)

    loop = _params(mesh)
    for i, (p, q) in enumerate(zip(params, loop)):
        p.grad = q.grad = distribute_tensor(ints(5, 3, seed=9 + i), mesh, [Shard(0)])
    seen = []
    real = DTensor.__torch_dispatch__.__func__

    def spy(cls, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return real(cls, func, types, args, kwargs)

    DTensor.__torch_dispatch__ = classmethod(spy)
    torch.optim.AdamW(params, lr=0.5, weight_decay=0.1).step()  # foreach=None: the default
    DTensor.__torch_dispatch__ = classmethod(real)
    assert any(name.startswith("aten._foreach_") for name in seen), seen
    assert len(seen) < 3 * 8, f"{len(seen)} dispatches for 3 parameters: not one per parameter and op"
    torch.optim.AdamW(loop, lr=0.5, weight_decay=0.1, foreach=False).step()
    for p, q in zip(params, loop):
        torch.testing.assert_close(p._local_tensor, q._local_tensor, atol=0, rtol=0)
