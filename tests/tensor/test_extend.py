"""What lies outside the rule table: the replicate-all fallback (correct, warns once per
op), a user's own op with a rule from register_sharding, and the collectives DTensor
inserts as CommDebugMode counts them (Linear -> GELU -> Linear, colwise then rowwise:
one all-reduce forward, one backward, as torch's DTensor).

Tolerance 1e-5 (float32): the sharded MLP sums its contraction in another order.
"""

import contextlib
import warnings

import torch
from torch import nn

from plait.debug import CommDebugMode
from plait.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, register_sharding
from plait.tensor import fallback as fallback_module
from plait.testing import distributed

from ._helpers import exact_dtensor, ints, mesh_for

TOL = dict(atol=1e-5, rtol=1e-5)


@torch.library.custom_op("plait_test::row_softmax", mutates_args=())
def row_softmax(x: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(x / temperature, dim=-1)


@row_softmax.register_fake
def _(x, temperature):
    return torch.empty_like(x)


@torch.library.custom_op("plait_test::plain_op", mutates_args=())
def plain_op(x: torch.Tensor) -> torch.Tensor:
    return x.flip(0) * 2


@plain_op.register_fake
def _(x):
    return torch.empty_like(x)


@register_sharding(torch.ops.plait_test.row_softmax.default)
def row_softmax_sharding(x, temperature):
    # softmax over the last dim: any other dim may be sharded; output like input
    options = [([Replicate()], [Replicate(), None])]
    options += [([Shard(d)], [Shard(d), None]) for d in range(x.ndim - 1)]
    return options


@contextlib.contextmanager
def _without_rules(*ops):
    """`ops` as if plait had no rule for them (the fallback's own subject)."""
    from plait.tensor import dispatch
    from plait.tensor.ops import RULES

    saved = {op: RULES.pop(op) for op in ops}
    dispatch._plans.clear()
    try:
        yield
    finally:
        RULES.update(saved)
        dispatch._plans.clear()


def _warned(fn, op):
    fallback_module._warned.discard(op)  # the pool's process may have warned before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
        fn()
    hits = [w for w in caught if str(op) in str(w.message)]
    return out, hits


@distributed([1, 2, 3])
def test_fallback_is_correct_and_warns_once(world_size):
    aten = torch.ops.aten
    with _without_rules(aten.cumsum.default, aten.cumsum_.default, aten.sort.default):
        _fallback_is_correct_and_warns_once(world_size)


def _fallback_is_correct_and_warns_once(world_size):
    mesh = mesh_for(world_size)
    full = ints(7, 4, seed=1)
    for placements in ([Shard(0)], [Shard(1)], [Partial()], [Replicate()]):
        x = exact_dtensor(full, mesh, placements)
        out, hits = _warned(lambda x=x: torch.cumsum(x, 0), torch.ops.aten.cumsum.default)
        assert len(hits) == 1 and "no sharding rule for aten.cumsum.default" in str(hits[0].message)
        assert out.placements == (Replicate(),)
        torch.testing.assert_close(out.full_tensor(), full.cumsum(0), atol=0, rtol=0)
        values, indices = torch.sort(x, dim=0)  # several outputs
        torch.testing.assert_close(values.full_tensor(), full.sort(0).values, atol=0, rtol=0)
        y = exact_dtensor(full, mesh, placements).clone()
        assert y.cumsum_(1) is y and y.placements == tuple(placements)  # written back in place
        torch.testing.assert_close(y.full_tensor(), full.cumsum(1), atol=0, rtol=0)
    # a custom op without a rule falls back too
    x = exact_dtensor(full, mesh, [Shard(0)])
    out, hits = _warned(lambda: torch.ops.plait_test.plain_op(x), torch.ops.plait_test.plain_op.default)
    assert len(hits) == 1
    torch.testing.assert_close(out.full_tensor(), full.flip(0) * 2, atol=0, rtol=0)


@distributed([2, 3])
def test_register_sharding_for_a_custom_op(world_size):
    mesh = mesh_for(world_size)
    full = ints(5, 6, seed=2)
    for placements, expected in (([Shard(0)], (Shard(0),)), ([Replicate()], (Replicate(),)),
                                 ([Shard(1)], (Shard(0),))):
        x = exact_dtensor(full, mesh, placements)
        with CommDebugMode() as mode, warnings.catch_warnings():
            warnings.simplefilter("error")  # a registered op never falls back
            out = torch.ops.plait_test.row_softmax(x, 2.0)
        assert out.placements == expected, (placements, out.placements)
        assert mode.get_total_counts() == (0 if placements != [Shard(1)] else 1)  # S(1) -> S(0): all-to-all
        torch.testing.assert_close(out.full_tensor(), torch.softmax(full / 2, -1), **TOL)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6))


def colwise_rowwise(model, mesh):
    """Tensor-parallel layout by hand: first Linear colwise (weight Shard(0), bias Shard(0)),
    second rowwise (weight Shard(1), bias Replicate)."""
    layout = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1), "2.bias": Replicate()}
    for name, placement in layout.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        param = getattr(module, attr)
        setattr(module, attr, nn.Parameter(distribute_tensor(param.detach(), mesh, [placement])))
    return model


@distributed([2, 3, 4])
def test_tensor_parallel_mlp_inserts_one_all_reduce_each_way(world_size):
    mesh = mesh_for(world_size)
    ref = _mlp()
    model = colwise_rowwise(_mlp(), mesh)
    x_full = ints(2, 3, 6, seed=3) / 4
    x = x_full.clone().requires_grad_()  # a plain activation, as tensor parallel receives it
    with CommDebugMode() as forward:
        y = model(DTensor.from_local(x, mesh, [Replicate()]))
        out = y.redistribute(mesh, [Replicate()])
    assert y.placements == (Partial(),)
    assert dict(forward.get_comm_counts()) == {"all_reduce": 1}, forward.get_comm_counts()
    with CommDebugMode() as backward:
        out.to_local().pow(2).sum().backward()
    assert dict(backward.get_comm_counts()) == {"all_reduce": 1}, backward.get_comm_counts()
    xr = x_full.clone().requires_grad_()
    ref(xr).pow(2).sum().backward()
    torch.testing.assert_close(out.to_local(), ref(x_full), **TOL)
    torch.testing.assert_close(x.grad, xr.grad, **TOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p.grad, DTensor)
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL, msg=name)
