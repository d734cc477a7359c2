"""_StridedShard: torch's placement for FSDP's dp shard of a TP shard.

Pure layout checks against torch's own `_compute_local_shape_and_global_offset` (even
sizes, where torch's interleaved formula and the nested chunk agree) and against the nested
torch.chunk by hand (uneven sizes too); then, on 4 ranks (2 x 2), distribute_tensor,
full_tensor, every redistribute to and from plain layouts (forward and backward), and ops.
Values are small integers and every move only copies them, so redistribution is exact
(atol = rtol = 0); ops compare with the plain tensor at float32 op tolerance (1e-5).
"""

import itertools
import pickle

import pytest
import torch
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Shard as TorchShard
from torch.distributed.tensor.placement_types import _StridedShard as TorchStrided

from plait.tensor import DTensor, Partial, Replicate, Shard, _StridedShard, distribute_tensor
from plait.tensor.placement import local_shape_and_offset, shard_order
from plait.testing import distributed

from ._helpers import exact_dtensor, ints, mesh_for

EXACT = dict(atol=0, rtol=0)
SS = _StridedShard


def test_name_repr_equality():
    p = SS(0, split_factor=2)
    assert repr(p) == "_StridedShard(dim=0, sf=2)" == repr(TorchStrided(0, split_factor=2))
    assert str(p) == "_S(0, 2)" and p == SS(0, sf=2) and hash(p) == hash(SS(0, sf=2))
    assert p != Shard(0) and Shard(0) != p and p != SS(0, sf=3) and p != SS(1, sf=2)
    assert not isinstance(p, Shard) and not p.is_shard() and not p.is_shard(0)  # as torch's
    assert pickle.loads(pickle.dumps(p)) == p
    with pytest.raises(TypeError, match="both"):
        SS(0, split_factor=2, sf=2)
    with pytest.raises(AttributeError):
        p.dim = 1


def _nested(size: int, cuts: list[tuple[int, int]]) -> tuple[int, int]:
    """(size, offset) of the piece that chunking arange(size) by (n, index), in order, leaves."""
    idx = torch.arange(size)
    for n, i in cuts:
        pieces = idx.chunk(n) if idx.numel() else ()
        idx = pieces[i] if i < len(pieces) else idx[:0]
    return idx.numel(), int(idx[0]) if idx.numel() else None


@pytest.mark.parametrize("dp,tp", [(2, 2), (3, 2), (2, 4), (4, 3)])
def test_local_shape_and_offset_is_the_dp_chunk_of_the_tp_chunk(dp, tp):
    placements = (SS(0, split_factor=tp), Shard(0))
    torch_placements = (TorchStrided(0, split_factor=tp), TorchShard(0))
    for rows in range(0, 3 * dp * tp + 2):
        for d, t in itertools.product(range(dp), range(tp)):
            shape, offset = local_shape_and_offset((rows, 3), placements, (dp, tp), (d, t))
            size, start = _nested(rows, [(tp, t), (dp, d)])
            assert shape == (size, 3), (rows, d, t)
            if size:
                assert offset == (start, 0), (rows, d, t)
            if rows % (dp * tp) == 0:  # even: torch's interleaved formula agrees
                assert (shape, offset) == _compute_local_shape_and_global_offset(
                    (rows, 3), (dp, tp), [d, t], torch_placements)


def test_hsdp_tp_layout_and_errors():
    # (dp_replicate, dp_shard, tp): the replicate axis holds whole TP-local pieces
    placements = (Replicate(), SS(0, split_factor=2), Shard(0))
    assert shard_order(placements, (2, 2, 2)) == {0: [2, 1]}
    assert local_shape_and_offset((8, 2), placements, (2, 2, 2), (1, 1, 0)) == ((2, 2), (2, 0))
    # alone on its dim it is torch's interleaved layout: rank r holds chunk r of each block
    assert shard_order((SS(0, split_factor=2), Replicate()), (2, 2)) == {0: [0]}
    assert local_shape_and_offset((8, 3), (SS(0, split_factor=2), Replicate()), (2, 2), (1, 0)) == ((4, 3), (2, 0))
    with pytest.raises(ValueError, match="waits for later mesh axes"):
        shard_order((SS(0, split_factor=4), Shard(0)), (2, 2))
    with pytest.raises(ValueError, match="cuts it into 3"):
        shard_order((SS(0, split_factor=2), Shard(0)), (2, 3))


PLAIN = [(Replicate(), Replicate()), (Shard(0), Shard(0)), (Replicate(), Shard(0)), (Shard(1), Shard(0)),
         (Shard(0), Shard(1)), (Partial(), Shard(0)), (Replicate(), Partial()), (Shard(1), Replicate())]
STRIDED = [(SS(0, split_factor=2), Shard(0)), (SS(1, split_factor=2), Shard(1))]


@distributed([4])
def test_distribute_full_tensor_and_every_redistribute():
    mesh = mesh_for(4, two_d=True)
    d, t = mesh.get_coordinate()
    for shape in [(8, 4), (7, 5), (3, 3)]:  # even, uneven, empty pieces
        full = ints(*shape, seed=sum(shape))
        for strided in STRIDED:
            x = distribute_tensor(full, mesh, strided)
            dim = strided[0].dim
            tp_piece = full.chunk(2, dim)[t] if t < len(full.chunk(2, dim)) else full.narrow(dim, 0, 0)
            pieces = tp_piece.chunk(2, dim) if tp_piece.size(dim) else ()
            mine = pieces[d] if d < len(pieces) else tp_piece.narrow(dim, 0, 0)
            torch.testing.assert_close(x.to_local(), mine, **EXACT)
            torch.testing.assert_close(x.full_tensor(), full, **EXACT)
            # gathering the strided axis alone yields the TP-local piece
            torch.testing.assert_close(x.redistribute(mesh, (Replicate(), strided[1])).to_local(), tp_piece, **EXACT)
            for plain in PLAIN:
                src = exact_dtensor(full, mesh, plain, requires_grad=True)
                y = src.redistribute(mesh, strided)
                assert y.placements == strided and tuple(y.to_local().shape) == y._spec.local_shape
                torch.testing.assert_close(y.to_local(), mine, **EXACT)
                g = ints(*shape, seed=9)
                (y.full_tensor() * g).sum().backward()
                want = tuple(Replicate() if isinstance(p, Partial) else p for p in plain)
                assert src.grad.placements == want
                torch.testing.assert_close(src.grad.full_tensor(), g, **EXACT)
                leaf = mine.clone().requires_grad_()
                z = DTensor.from_local(leaf, mesh, strided, shape=full.shape).redistribute(mesh, plain)
                torch.testing.assert_close(z.full_tensor(), full, **EXACT)
                (z.full_tensor() * g).sum().backward()
                # the gradient comes back in the strided layout: this rank's piece of g
                g_mine = distribute_tensor(g, mesh, strided).to_local()
                torch.testing.assert_close(leaf.grad, g_mine, **EXACT)


@distributed([4])
def test_ops_on_strided_dtensors():
    mesh = mesh_for(4, two_d=True)
    placements = (SS(0, split_factor=2), Shard(0))
    a_full, b_full = ints(6, 4, seed=1), ints(6, 4, seed=2)
    a, b = distribute_tensor(a_full, mesh, placements), distribute_tensor(b_full, mesh, placements)
    tol = dict(atol=1e-5, rtol=1e-5)
    # pointwise and foreach ops keep the layout, with no communication
    c = a * 2 + b.sigmoid()
    assert c.placements == placements
    torch.testing.assert_close(c.full_tensor(), a_full * 2 + b_full.sigmoid(), **tol)
    row = distribute_tensor(ints(4, seed=3), mesh, (Replicate(), Replicate()))
    assert (a + row).placements == placements  # a broadcast operand stays Replicate
    torch.testing.assert_close((a + row).full_tensor(), a_full + ints(4, seed=3), **tol)
    outs = torch._foreach_add([a, b], [b, a], alpha=0.5)
    assert all(o.placements == placements for o in outs)
    torch.testing.assert_close(outs[0].full_tensor(), a_full + 0.5 * b_full, **tol)
    z = torch.zeros_like(a)
    assert z.placements == placements and z.to_local().shape == a.to_local().shape
    # reductions: a strided piece reduces like a Shard (Partial), no gather first
    torch.testing.assert_close(a.sum().full_tensor(), a_full.sum(), **tol)
    torch.testing.assert_close(a.sum(1).full_tensor(), a_full.sum(1), **tol)
    torch.testing.assert_close(torch.linalg.vector_norm(a).full_tensor(), torch.linalg.vector_norm(a_full), **tol)
    norms = torch._foreach_norm([a, b])
    torch.testing.assert_close(norms[1].full_tensor(), torch.linalg.vector_norm(b_full), **tol)
    # other ops gather the strided axis first
    w = distribute_tensor(ints(4, 3, seed=4), mesh, (Replicate(), Replicate()))
    torch.testing.assert_close((a @ w).full_tensor(), a_full @ ints(4, 3, seed=4), **tol)
    assert a.t().placements == (SS(1, split_factor=2), Shard(1))  # permutes move the block's dims
    torch.testing.assert_close(a.t().full_tensor(), a_full.t(), **tol)
    torch.testing.assert_close(a.unsqueeze(0).permute(2, 0, 1).full_tensor(), a_full.unsqueeze(0).permute(2, 0, 1))
    v = a.view(6, 2, 2)  # reshapes that leave the strided dim whole keep the layout
    assert v.placements == placements and a.unsqueeze(0).placements == (SS(1, split_factor=2), Shard(1))
    torch.testing.assert_close(v.full_tensor(), a_full.view(6, 2, 2), **tol)
    torch.testing.assert_close(a.reshape(-1).full_tensor(), a_full.reshape(-1), **tol)  # others gather first
    torch.testing.assert_close(a.view(3, 8).full_tensor(), a_full.view(3, 8), **tol)
    torch.testing.assert_close(a[1:4].full_tensor(), a_full[1:4], **tol)
    # in place on a strided DTensor, as an optimizer does
    a.mul_(0.5).add_(b)
    assert a.placements == placements
    torch.testing.assert_close(a.full_tensor(), a_full * 0.5 + b_full, **tol)
