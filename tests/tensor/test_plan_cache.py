"""dispatch's plan cache: a pointwise op's Python float arguments key its plan by type
(an optimizer's per-step scalars reuse one plan), yet every call computes with its own
value; an in-place op returns the DTensor it wrote (its fast path). Exact equality: the
local ops are the same ops on the same values."""

import torch

from plait.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from plait.tensor import dispatch as dispatch_mod
from plait.testing import distributed

from ._helpers import mesh_for


@distributed([2])
def test_float_args_share_a_plan_and_keep_their_values():
    mesh = mesh_for(2)
    full = torch.arange(12.0).view(6, 2)
    x = distribute_tensor(full.clone(), mesh, [Shard(0)])
    y = distribute_tensor(full.clone(), mesh, [Shard(0)])
    x.mul_(0.5)  # builds the plans
    x.addcdiv_(y, y + 1.0, value=-0.1)
    before = len(dispatch_mod._plans)
    expected = full * 0.5
    expected = expected + -0.1 * full / (full + 1.0)
    for scale, value in ((0.25, -0.2), (3.0, 0.7), (float("nan"), 1.5)):
        out = x.mul_(scale)
        assert out is x  # in place: the same DTensor comes back
        x.addcdiv_(y, y + 1.0, value=value)
        expected = expected * scale + value * full / (full + 1.0)
        torch.testing.assert_close(x.full_tensor(), expected, rtol=0, atol=0, equal_nan=True)
    assert len(dispatch_mod._plans) == before, "a new float value built a new plan"


@distributed([2])
def test_masked_fill_value_still_keys_its_plan():
    """masked_fill's rule reads its value (a zero fill of a Partial is linear, any other is
    not), so its float stays in the key: a fill with 1.0 after one with 0.0 must not reuse
    the zero fill's Partial plan (that would put 1 + 1 = 2 where the mask is)."""
    mesh = mesh_for(2)
    p = DTensor.from_local(torch.ones(4), mesh, [Partial()])  # global value 2 everywhere
    mask = distribute_tensor(torch.tensor([True, False, True, False]), mesh, [Replicate()])
    zero, one = p.masked_fill(mask, 0.0), p.masked_fill(mask, 1.0)
    assert zero.placements == (Partial(),)  # linear: no collective
    torch.testing.assert_close(zero.full_tensor(), torch.tensor([0.0, 2.0, 0.0, 2.0]))
    torch.testing.assert_close(one.full_tensor(), torch.tensor([1.0, 2.0, 1.0, 2.0]))
