"""An optimizer left at foreach=None treats DTensor parameters as torch does once
torch.distributed.tensor is imported: foreach wherever the device has foreach kernels;
and a parameter group that mixes DTensors with plain tensors (a TP model's norms stay plain)
steps under foreach as under the loop, where torch's DTensor raises.

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


def _params(mesh, plain: tuple[int, ...] = ()) -> list[nn.Parameter]:
    """Three (5, 3) parameters sharded on dim 0; those in `plain` left plain tensors."""
    return [nn.Parameter(ints(5, 3, seed=i) if i in plain else distribute_tensor(ints(5, 3, seed=i), mesh, [Shard(0)]))
            for i in range(3)]


def _grads(mesh, params: list[nn.Parameter], loop: list[nn.Parameter]) -> None:
    for i, (p, q) in enumerate(zip(params, loop)):
        g = ints(5, 3, seed=9 + i)
        p.grad = q.grad = distribute_tensor(g, mesh, [Shard(0)]) if isinstance(p, DTensor) else g


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
    _grads(mesh, params, loop)
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
        torch.testing.assert_close(_local(p), _local(q), atol=0, rtol=0)


@distributed([2])
def test_a_group_mixing_dtensor_and_plain_parameters_steps_as_the_loop_does():
    """AdamW and SGD with foreach=True over [DTensor, plain, DTensor] parameters: one call per
    kind and op, the plain indices as plain tensors; bit for bit the loop's step."""
    mesh = mesh_for(2)
    for make in (lambda ps, f: torch.optim.AdamW(ps, lr=0.5, weight_decay=0.1, foreach=f),
                 lambda ps, f: torch.optim.SGD(ps, lr=0.5, momentum=0.9, foreach=f)):
        params, loop = _params(mesh, plain=(1,)), _params(mesh, plain=(1,))
        foreach, plain_loop = make(params, True), make(loop, False)
        for _ in range(2):
            _grads(mesh, params, loop)
            foreach.step()
            plain_loop.step()
        assert [type(p.data) for p in params] == [DTensor, torch.Tensor, DTensor]
        for p, q in zip(params, loop):
            torch.testing.assert_close(_local(p), _local(q), atol=0, rtol=0)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t.detach()
