"""Transformer ops on DTensors equal plain ones: layer_norm and RMS norm (forward and
backward), embedding (vocabulary-sharded weight: masked lookup -> Partial), cross-entropy
/ nll_loss (batch-sharded, uneven, ignore_index, every reduction), scaled_dot_product_
attention (heads or batch sharded, causal, masked) and dropout (the same mask as a
single-process run), with the placements that matter for each, values and gradients.

Tolerances: tests/tensor/_helpers.py (float32 1e-4; bfloat16 6e-2); dropout masks and
embedding lookups are exact.
"""

import torch
import torch.nn.functional as F

from plait.debug import CommDebugMode
from plait.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from plait.testing import distributed

from ._helpers import check, combos, exact_dtensor, ints, mesh_for

R = Replicate()


def _ln(x, w, b):
    return F.layer_norm(x, (4,), w, b)


def _rms(x, w):
    return F.rms_norm(x, (4,), w, eps=1e-5)


def _fused_rms(x, w):
    return torch.ops.aten._fused_rms_norm(x, [4], w, 1e-5)[0]


@distributed([1, 2, 3, 4])
def test_norms(world_size):
    mesh = mesh_for(world_size)
    x, w, b = ints(3, 5, 4, seed=1) / 2, ints(4, seed=2) / 2 + 1, ints(4, seed=3) / 2
    for px, pw, pb in combos([3, 1, 1], mesh, limit={1: None, 2: 30}.get(world_size, 8)):
        check(_ln, [x, w, b], [px, pw, pb], mesh, what="layer_norm")
    for px, pw in combos([3, 1], mesh, seed=1):
        check(_rms, [x, w], [px, pw], mesh, what="rms_norm")
        check(_fused_rms, [x, w], [px, pw], mesh, what="_fused_rms_norm")
    if world_size == 2:
        check(_ln, [x, w, b], [[Shard(1)], [R], [R]], mesh, dtype=torch.bfloat16, what="ln bf16")


def _emb(weight, indices):
    return F.embedding(indices, weight)


@distributed([1, 2, 3, 4])
def test_embedding(world_size):
    mesh = mesh_for(world_size)
    weight = ints(7, 5, seed=1)  # 7 rows: uneven vocabulary pieces
    idx = torch.tensor([[0, 6, 3, 3], [5, 1, 6, 2]])
    for pw, pi in combos([2, 2], mesh, seed=2):
        if isinstance(pi[0], Partial):
            continue  # indices are integers: a Partial of them is meaningless
        check(_emb, [weight, idx], [pw, pi], mesh, what="embedding")
    check(lambda w, i: F.embedding(i, w, padding_idx=3), [weight, idx], [[Shard(0)], [R]], mesh, what="pad")
    small = ints(2, 3, seed=2)  # 2 rows on 3-4 ranks: some ranks own no row at all
    check(_emb, [small, torch.tensor([1, 0, 1])], [[Shard(0)], [R]], mesh, what="tiny vocab")
    w = exact_dtensor(weight, mesh, [Shard(0)])
    i = distribute_tensor(idx, mesh, [R])
    with CommDebugMode() as mode:
        out = F.embedding(i, w)
    assert mode.get_total_counts() == 0 and out.placements == (Partial(),)


def _ce(reduction, ignore=-100):
    return lambda x, t: F.cross_entropy(x, t, reduction=reduction, ignore_index=ignore)


@distributed([1, 2, 3, 4])
def test_cross_entropy(world_size):
    mesh = mesh_for(world_size)
    logits = ints(7, 5, seed=1) / 2  # 7 samples: uneven batch pieces
    target = torch.tensor([0, 4, 2, 2, 1, 3, 0])
    for reduction in ("mean", "sum", "none"):
        for px, pt in combos([2, 1], mesh, seed=3):
            if isinstance(pt[0], Partial):
                continue
            check(_ce(reduction), [logits, target], [px, pt], mesh, what=f"ce {reduction}")
    ignored = target.clone()
    ignored[[1, 5, 6]] = -100
    for p in ([Shard(0)], [R]):
        check(_ce("mean"), [logits, ignored], [p, p], mesh, what="ce ignore_index")
    weight = ints(5, seed=4).abs() + 1
    check(lambda x, t, w: F.cross_entropy(x, t, weight=w), [logits, target, weight],
          [[Shard(0)], [Shard(0)], [R]], mesh, what="ce class weights", frozen=(2,))


def _sdpa(causal):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@distributed([1, 2, 3, 4])
def test_attention(world_size):
    mesh = mesh_for(world_size)
    q, k, v = (ints(2, 3, 5, 4, seed=s) / 4 for s in (1, 2, 3))  # (B, H, T, D): 3 heads, uneven
    for p in ([Shard(1)], [Shard(0)], [R], [Shard(2)]):
        for causal in (False, True):
            check(_sdpa(causal), [q, k, v], [p, p, p], mesh, what=f"sdpa causal={causal}")
    mask = ints(5, 5, seed=4) > -2
    check(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), [q, k, v, mask],
          [[Shard(1)], [Shard(1)], [Shard(1)], [R]], mesh, what="sdpa mask")
    heads = [exact_dtensor(t, mesh, [Shard(1)]) for t in (q, k, v)]
    with CommDebugMode() as mode:
        out = F.scaled_dot_product_attention(*heads)
    assert mode.get_total_counts() == 0 and out.placements == (Shard(1),)


@distributed([1, 2, 3, 4])
def test_dropout_matches_a_single_process_draw(world_size):
    mesh = mesh_for(world_size)
    full = ints(7, 6, seed=1) + 5
    for placements in ([R], [Shard(0)], [Shard(1)], [Partial()]):
        torch.manual_seed(5)
        expected = F.dropout(full, 0.5)
        expected_native = torch.ops.aten.native_dropout(full, 0.3, True)
        torch.manual_seed(5)
        x = exact_dtensor(full, mesh, placements)
        got = F.dropout(x, 0.5)
        out, mask = torch.ops.aten.native_dropout(x, 0.3, True)
        assert isinstance(got, DTensor)
        torch.testing.assert_close(got.full_tensor(), expected, **dict(atol=1e-5, rtol=1e-6)
                                   if placements == [Partial()] else dict(atol=0, rtol=0))
        # a Partial input is scaled piece by piece, then summed: one rounding more
        exact = dict(atol=0, rtol=0) if placements != [Partial()] else dict(atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(out.full_tensor(), expected_native[0], **exact)
        assert mask.dtype == torch.bool and torch.equal(mask.full_tensor(), expected_native[1])
    x = exact_dtensor(full, mesh, [Shard(0)], requires_grad=True)
    torch.manual_seed(6)
    y = F.dropout(x, 0.25)
    (y.full_tensor() * 2).sum().backward()
    torch.manual_seed(6)
    ref = full.clone().requires_grad_()
    (F.dropout(ref, 0.25) * 2).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), ref.grad, atol=0, rtol=0)
    assert torch.equal(F.dropout(x, 0.5, training=False).full_tensor(), full)
    meshes = [mesh_for(4, two_d=True)] if world_size == 4 else []
    for m, placements in [(mesh, [Shard(1)])] + [(m, [Shard(0), Shard(1)]) for m in meshes]:
        bf = full.to(torch.bfloat16)
        torch.manual_seed(8)
        expected = F.dropout(bf, 0.4)
        torch.manual_seed(8)
        got = F.dropout(exact_dtensor(bf, m, placements), 0.4)
        torch.testing.assert_close(got.full_tensor(), expected, atol=0, rtol=0)


@distributed([2, 4])
def test_nn_ops_bfloat16_and_2x2(world_size):
    mesh = mesh_for(world_size)
    two_d = [mesh] + ([mesh_for(4, two_d=True)] if world_size == 4 else [])
    x, w, b = ints(3, 5, 4, seed=1) / 2, ints(4, seed=2) / 2 + 1, ints(4, seed=3) / 2
    weight, idx = ints(7, 5, seed=1), torch.tensor([[0, 6, 3, 3], [5, 1, 6, 2]])
    logits, target = ints(7, 5, seed=1) / 2, torch.tensor([0, 4, 2, 2, 1, 3, 0])
    q, k, v = (ints(2, 4, 5, 4, seed=s) / 4 for s in (1, 2, 3))
    for m in two_d:
        dtype = torch.bfloat16 if m.ndim == 1 else torch.float32
        for px, pw, pb in combos([3, 1, 1], m, limit=4, seed=1):
            check(_ln, [x, w, b], [px, pw, pb], m, dtype=dtype, what=f"layer_norm {m.shape}")
        for pw, pi in combos([2, 2], m, partial=False, limit=4, seed=2):
            check(_emb, [weight, idx], [pw, pi], m, dtype=dtype, what=f"embedding {m.shape}")
        for px, pt in combos([2, 1], m, partial=False, limit=4, seed=3):
            check(_ce("mean"), [logits, target], [px, pt], m, dtype=dtype, what=f"ce {m.shape}")
        heads = [Shard(1)] * m.ndim if m.ndim == 1 else [Shard(0), Shard(1)]
        check(_sdpa(True), [q, k, v], [heads] * 3, m, dtype=dtype, what=f"sdpa {m.shape}")
