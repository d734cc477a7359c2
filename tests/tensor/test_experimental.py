"""plait.tensor.experimental, as torch's: local_map runs plain-tensor code on local pieces
(forward and backward agree with the plain computation), implicit_replication lets a plain
tensor meet a DTensor, register_sharding replaces plait's own rule for an op.

Tolerance 1e-5 (float32): the sharded matmul sums its contraction in another order; the
other checks are elementwise on small integers and exact.
"""

import pytest
import torch

from plait.debug import CommDebugMode
from plait.tensor import DTensor, Partial, Replicate, Shard
from plait.tensor import dispatch as dispatch_module
from plait.tensor.experimental import implicit_replication, local_map, register_sharding
from plait.tensor.ops import RULES
from plait.tensor.ops import registry as registry_module
from plait.testing import distributed

from ._helpers import exact_dtensor, ints, mesh_for

TOL = dict(atol=1e-5, rtol=1e-5)


def _leaf(full, mesh, placements):
    return exact_dtensor(full, mesh, placements, requires_grad=True)


@distributed([2])
def test_local_map_matmul_forward_and_backward_match_plain(world_size):
    """torch's docstring example: W column-wise, X row-wise, each rank's mm is a partial sum."""
    mesh = mesh_for(world_size)
    w_full, x_full = ints(4, 6, seed=1), ints(6, 5, seed=2)
    w, x = _leaf(w_full, mesh, [Shard(1)]), _leaf(x_full, mesh, [Shard(0)])
    local_mm = local_map(torch.mm, out_placements=[Partial()], in_placements=([Shard(1)], [Shard(0)]))
    with CommDebugMode() as mode:
        y = local_mm(w, x)
    assert mode.get_total_counts() == 0  # the inputs already are where in_placements wants them
    assert isinstance(y, DTensor) and y.placements == (Partial(),) and y.shape == (4, 5)
    y.full_tensor().pow(2).sum().backward()
    wr, xr = w_full.clone().requires_grad_(), x_full.clone().requires_grad_()
    (wr @ xr).pow(2).sum().backward()
    torch.testing.assert_close(y.full_tensor(), wr @ xr, **TOL)
    assert w.grad.placements == (Shard(1),) and x.grad.placements == (Shard(0),)
    torch.testing.assert_close(w.grad.full_tensor(), wr.grad, **TOL)
    torch.testing.assert_close(x.grad.full_tensor(), xr.grad, **TOL)


@distributed([2])
def test_local_map_nested_outputs_non_tensor_args_and_decorator(world_size):
    mesh = mesh_for(world_size)
    full = ints(6, 3, seed=3)
    x = _leaf(full, mesh, [Shard(0)])

    @local_map(out_placements=([Shard(0)], None), in_placements=([Shard(0)], None))
    def scaled_tanh(t, s, *, shift):
        return torch.tanh(t) * s + shift, t.shape[0]  # a tensor and a non-tensor output

    y, rows = scaled_tanh(x, 2.0, shift=1.0)
    assert rows == 3 and y.placements == (Shard(0),)  # each rank's own piece: 6 rows on 2
    y.full_tensor().sum().backward()
    xr = full.clone().requires_grad_()
    (torch.tanh(xr) * 2.0 + 1.0).sum().backward()
    torch.testing.assert_close(y.full_tensor(), torch.tanh(full) * 2.0 + 1.0, **TOL)
    torch.testing.assert_close(x.grad.full_tensor(), xr.grad, **TOL)
    # no DTensor argument: the function runs as it is and returns plain values
    plain, _ = scaled_tanh(full, 2.0, shift=1.0)
    assert type(plain) is torch.Tensor and plain.shape == (6, 3)


@distributed([2])
def test_local_map_redistributes_inputs_only_when_asked(world_size):
    mesh = mesh_for(world_size)
    full = ints(4, 6, seed=4)
    x = _leaf(full, mesh, [Replicate()])
    strict = local_map(torch.neg, out_placements=[Shard(1)], in_placements=([Shard(1)],))
    with pytest.raises(ValueError, match=r"redistribute_inputs=True"):
        strict(x)
    with pytest.raises(ValueError, match=r"in_placements has 2 entries for 1"):
        local_map(torch.neg, [Shard(1)], ([Shard(1)], None))(x)
    moving = local_map(torch.neg, out_placements=[Shard(1)], in_placements=([Shard(1)],),
                       redistribute_inputs=True)
    y = moving(x)
    assert y.placements == (Shard(1),) and y.to_local().shape == (4, 3)
    torch.testing.assert_close(y.full_tensor(), -full, atol=0, rtol=0)
    (y.full_tensor() * ints(4, 6, seed=5)).sum().backward()
    assert x.grad.placements == (Replicate(),)  # the reverse of the move: back to Replicate
    torch.testing.assert_close(x.grad.full_tensor(), -ints(4, 6, seed=5), atol=0, rtol=0)


@distributed([2])
def test_local_map_in_grad_placements_mark_a_partial_input_gradient(world_size):
    """x replicated, w column-sharded: each rank's d(loss)/d(x_local) is a partial sum, which
    in_grad_placements=Partial says; x.grad then adds the ranks' pieces (torch's hint)."""
    mesh = mesh_for(world_size)
    x_full, w_full = ints(3, 4, seed=9), ints(4, 6, seed=10)
    x, w = _leaf(x_full, mesh, [Replicate()]), _leaf(w_full, mesh, [Shard(1)])
    local_mm = local_map(torch.mm, out_placements=[Shard(1)], in_placements=([Replicate()], [Shard(1)]),
                         in_grad_placements=([Partial()], [Shard(1)]))
    y = local_mm(x, w)
    y.full_tensor().pow(2).sum().backward()
    xr, wr = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    (xr @ wr).pow(2).sum().backward()
    torch.testing.assert_close(y.full_tensor(), xr @ wr, **TOL)
    torch.testing.assert_close(x.grad.full_tensor(), xr.grad, **TOL)
    torch.testing.assert_close(w.grad.full_tensor(), wr.grad, **TOL)


@distributed([2])
def test_implicit_replication_lets_plain_tensors_meet_dtensors(world_size):
    mesh = mesh_for(world_size)
    full, plain = ints(4, 6, seed=6), ints(4, 6, seed=7)
    x = _leaf(full, mesh, [Shard(0)])
    with pytest.raises(ValueError, match=r"implicit_replication"):
        x + plain  # plait's rule outside the block: only 0-dim tensors mix
    with implicit_replication():
        with implicit_replication():
            pass  # a nested block leaves the flag as it found it
        y = x * plain + plain[0]  # plain (4, 6) and (6,), either side: Replicate on x's mesh
        z = plain - x
        # backward multiplies the grad by the saved plain tensor: inside the block too (as torch)
        y.sum().backward()
    assert not dispatch_module._allow_implicit_replication
    assert isinstance(y, DTensor) and isinstance(z, DTensor)
    torch.testing.assert_close(y.full_tensor(), full * plain + plain[0], atol=0, rtol=0)
    torch.testing.assert_close(z.full_tensor(), plain - full, atol=0, rtol=0)
    torch.testing.assert_close(x.grad.full_tensor(), plain, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"mixed with DTensors"):
        x - plain  # and not after it


@distributed([2])
def test_register_sharding_overrides_a_builtin_rule(world_size):
    mesh = mesh_for(world_size)
    full = ints(4, 6, seed=8)
    x = exact_dtensor(full, mesh, [Shard(0)])
    op = torch.ops.aten._softmax.default
    assert torch.softmax(x, -1).placements == (Shard(0),)  # plait's rule: rows stay sharded (plan cached)
    own = RULES[op]
    try:
        @register_sharding(op)
        def replicate_only(t, dim, half_to_float):
            assert t.ndim == 2 and t.placements == (Shard(0),)  # the rule sees specs
            return [([Replicate()], [Replicate(), None, None])]

        with CommDebugMode() as mode:
            y = torch.softmax(x, -1)
        assert y.placements == (Replicate(),)  # the user's rule, not the cached plan
        assert dict(mode.get_comm_counts()) == {"all_gather": 1}
        torch.testing.assert_close(y.to_local(), torch.softmax(full, -1), **TOL)
    finally:  # the pool's process runs other tests next: give the op its own rule back
        RULES[op] = own
        registry_module._forget_plans([op])
    assert torch.softmax(x, -1).placements == (Shard(0),)
