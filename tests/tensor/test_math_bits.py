"""Complex DTensors give one device's numbers: lazy conj and neg bits, complex kernels, the
rotary embedding of torch's fsdp_tp example; in-place view ops; the fallback's switch.

The conj bit was dropped when a local was wrapped, and inside __torch_dispatch__ the
Conjugate key is excluded anyway: `g * f.conj()` computed `g * f`, which made every wq/wk
gradient of the fsdp_tp example wrong by order 1. Tolerance: float32/complex64 at 1e-5
(sharded sums reorder terms); the bit cases are exact.
"""

import pytest
import torch

from plait.tensor import DTensor, Replicate, Shard, distribute_tensor
from plait.tensor.debug import fallback_counts, fallback_policy, reset_fallback_counts
from plait.testing import distributed

from ._helpers import mesh_for

TOL = dict(atol=1e-5, rtol=1e-5)


def _complex(*shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))


@distributed([1, 2, 3])
def test_conj_and_neg_bits_are_carried_and_resolved(world_size):
    mesh = mesh_for(world_size)
    f, g = _complex(5, 4, seed=0), _complex(5, 4, seed=1)
    for placements in ([Replicate()], [Shard(0)], [Shard(1)]):
        fd, gd = distribute_tensor(f, mesh, placements), distribute_tensor(g, mesh, placements)
        c = fd.conj()
        assert c.is_conj() and c._local_tensor.is_conj() and c.placements == tuple(placements)
        # (a piece's complex multiply may take another vector path: 1 ulp)
        torch.testing.assert_close((gd * c).full_tensor(), g * f.conj(), atol=1e-6, rtol=1e-6)
        assert torch.equal((c + 0).full_tensor(), f.conj())
        assert torch.equal(c.imag.full_tensor(), f.conj().imag)  # a neg view of a conj's view_as_real
        assert torch.equal(c.resolve_conj().full_tensor(), f.conj().resolve_conj())
        assert torch.equal(torch.view_as_real(fd).full_tensor(), torch.view_as_real(f))
        assert torch.view_as_real(fd).placements == tuple(placements)
        n = torch._neg_view(distribute_tensor(f.real.contiguous(), mesh, placements))
        assert n.is_neg() and torch.equal((n * 1).full_tensor(), -f.real)


@distributed([2])
def test_complex_kernels_see_their_own_conj_views():
    # linalg_pinv makes mH views inside its kernel: under __torch_dispatch__ they read raw
    mesh = mesh_for(2)
    a = _complex(3, 5, seed=2)
    got = torch.linalg.pinv(distribute_tensor(a, mesh, [Replicate()]))
    torch.testing.assert_close(got.full_tensor(), torch.linalg.pinv(a), **TOL)


def _rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """torch's llama2_model apply_rotary_emb on (b, s, h, hd), freqs (s, hd / 2) complex."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs.view(1, xc.shape[1], 1, xc.shape[-1])).flatten(3)


@distributed([2, 3])
def test_complex_rotary_gradients_equal_one_device(world_size):
    mesh = mesh_for(world_size)
    torch.manual_seed(0)
    x = torch.randn(2, 6, 3 * world_size, 8, requires_grad=True)  # heads sharded, as TP shards them
    freqs = torch.polar(torch.ones(6, 4), torch.randn(6, 4))
    w = torch.randn(2, 6, 3 * world_size, 8)
    (_rotary(x, freqs) * w).sum().backward()
    xd = distribute_tensor(x.detach(), mesh, [Shard(2)]).requires_grad_()
    fd = distribute_tensor(freqs, mesh, [Replicate()])  # PrepareModuleInput's Replicate freqs_cis
    with fallback_policy("error"):
        out = _rotary(xd, fd)
        assert out.placements == (Shard(2),)
        (out * distribute_tensor(w, mesh, [Shard(2)])).sum().backward()
    torch.testing.assert_close(xd.grad.full_tensor(), x.grad, **TOL)


@distributed([1, 2])
def test_in_place_views_change_the_dtensor(world_size):
    mesh = mesh_for(world_size)
    cases = {  # name: (fn, placements before, placements after)
        "squeeze_": (lambda t: t.squeeze_(0), Shard(2), Shard(1)),
        "unsqueeze_": (lambda t: t.unsqueeze_(1), Shard(2), Shard(3)),
        "transpose_": (lambda t: t.transpose_(1, 2), Shard(2), Shard(1)),
    }
    for name, (fn, before, after) in cases.items():
        x = torch.arange(24.0).reshape(1, 4, 6)
        d = distribute_tensor(x.clone(), mesh, [before])
        assert fn(d) is d, name
        expected = fn(x.clone())
        assert d.shape == expected.shape and d.placements == (after,), (name, d.shape, d.placements)
        assert torch.equal(d.full_tensor(), expected), name


@distributed([2])
def test_fallback_error_policy_names_the_op_and_counts():
    from plait.tensor.ops import RULES

    mesh = mesh_for(2)
    x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    op = torch.ops.aten.nonzero.default
    assert op not in RULES  # data-dependent output shape: replicated by the fallback
    reset_fallback_counts()
    with fallback_policy("error"), pytest.raises(NotImplementedError, match=r"aten.nonzero.default .*\[Shard\(dim=0\)\]"):
        torch.nonzero(x)
    out = torch.nonzero(x)  # the default policy: right, gathered, counted
    assert isinstance(out, DTensor) and torch.equal(out.full_tensor(), torch.nonzero(torch.arange(8.0).reshape(4, 2)))
    assert fallback_counts() == {"aten.nonzero.default": 2}
