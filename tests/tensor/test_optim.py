"""torch optimizers and clip_grad_norm_ on DTensor parameters equal the same steps on
plain parameters: AdamW and SGD with momentum, for-loop and foreach implementations,
parameters sharded on either dim (unevenly), replicated, and on a 2x2 mesh.

Tolerance 1e-5 (float32): the gradients are computed by sharded matmuls (sums in
another order); Adam's update divides by sqrt of the second moment, which keeps
relative errors at that level over a few steps.
"""

import copy

import torch
from torch import nn

from plait.tensor import DTensor, Replicate, Shard, distribute_tensor
from plait.testing import distributed

from ._helpers import mesh_for, piece

TOL = dict(atol=1e-5, rtol=1e-5)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _distribute(model, mesh, layout):
    for (name, param), placements in zip(list(model.named_parameters()), layout):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(distribute_tensor(param.detach(), mesh, placements)))
    return model


def _steps(model, opt, clip: bool, steps: int = 3):
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 5)
        if isinstance(model[0].weight, DTensor):
            x = distribute_tensor(x, model[0].weight.device_mesh, [Replicate()] * model[0].weight.device_mesh.ndim)
        out = model(x)
        loss = (out.full_tensor() if isinstance(out, DTensor) else out).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=opt.defaults.get("foreach"))
            losses.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        opt.step()
        losses.append(float(loss))
    return losses


def _compare(mesh, layout, make_opt, clip):
    ref = _model()
    model = _distribute(copy.deepcopy(ref), mesh, layout)
    expected = _steps(ref, make_opt(ref.parameters()), clip)
    got = _steps(model, make_opt(model.parameters()), clip)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **TOL)
    for p, q, placements in zip(model.parameters(), ref.parameters(), layout):
        assert p.placements == tuple(placements), "a step must not move a parameter"
        torch.testing.assert_close(p.to_local(), piece(q.detach(), p._spec), **TOL)


OPTIMIZERS = {
    "adamw": lambda params, foreach: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, foreach=foreach),
    "sgd": lambda params, foreach: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=foreach),
}


@distributed([1, 2, 3])
def test_optimizers_step_like_plain_parameters(world_size):
    mesh = mesh_for(world_size)
    S0, S1, R = [Shard(0)], [Shard(1)], [Replicate()]
    layout = [S0, S0, S1, R]  # colwise then rowwise, as tensor parallel lays them out
    for name, make in OPTIMIZERS.items():
        for foreach in (False, True):
            _compare(mesh, layout, lambda params, make=make, foreach=foreach: make(params, foreach),
                     clip=name == "adamw")
    _compare(mesh, [R, S0, S0, S0], lambda params: OPTIMIZERS["adamw"](params, True), clip=True)


@distributed([4])
def test_optimizers_on_2x2():
    mesh = mesh_for(4, two_d=True)
    layout = [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()], [Shard(0), Shard(0)]]
    _compare(mesh, layout, lambda params: OPTIMIZERS["adamw"](params, True), clip=True)
    _compare(mesh, layout, lambda params: OPTIMIZERS["sgd"](params, False), clip=False)
