"""Context parallel, as torch's: inside `context_parallel(mesh)` SDPA on each rank's sequence
shard is exact attention over the whole sequence, forward and backward.

Every multi-rank test builds the same full q, k, v on every rank, runs single-process
`F.scaled_dot_product_attention` on them as the reference, and compares each rank's output
and q/k/v gradients with the reference's rows at the positions that rank holds.

Tolerances:
    float32   atol 2e-5, rtol 1e-5: the ring adds the softmax over blocks in another order
              (log-sum-exp merges) than the fused kernel; values are O(1).
    bfloat16  atol 2e-2, rtol 2e-2: the reference is fp32 SDPA on the same bf16 values; the
              ring computes in fp32 too and rounds its results to bf16 once (a step of 2^-8
              relative on values of magnitude <= ~3).
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from plait import comm
from plait.debug import CommDebugMode
from plait.device_mesh import init_device_mesh
from plait.tensor.experimental import context_parallel, context_parallel_unshard, set_rotate_method
from plait.tensor.experimental import cp_context as cp_module
from plait.tensor.experimental import ring_attention as ring
from plait.tensor.experimental.ring_plan import block_mask, local_positions, ring_blocks
from plait.testing import distributed

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
B, HQ, S, D = 2, 4, 24, 8  # 24 splits into 2*cp chunks for cp = 2, 3, 4


def cp_mesh(n):
    return init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))


def full_inputs(hkv, dtype, seed=0, seq=S):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, h, seq, D, generator=g).to(dtype) for h in (HQ, hkv, hkv, HQ))
    return q, k, v, dout


def reference(q, k, v, dout, is_causal):
    leaves = [t.detach().float().clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, enable_gqa=True)
    out.backward(dout.float())
    return out.detach(), *(t.grad for t in leaves)


def ring_run(mesh, q, k, v, dout, is_causal):
    """Shard q, k, v, dout as context_parallel does and run SDPA inside it: (out, dq, dk, dv) local."""
    shards = [t.clone() for t in (q, k, v, dout)]
    with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2] * 4, no_restore_buffers=set(shards)):
        leaves = [t.clone().requires_grad_() for t in shards[:3]]
        out = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, enable_gqa=True)
        out.backward(shards[3])
    return out.detach(), *(t.grad for t in leaves)


@contextlib.contextmanager
def options(method="allgather", load_balance=True):
    """Set the (process-global, as torch's) options on this rank, back to the defaults after."""
    set_rotate_method(method)
    cp_module._cp_options.enable_load_balance = load_balance
    try:
        yield
    finally:
        set_rotate_method("allgather")
        cp_module._cp_options.enable_load_balance = True


@distributed([2, 3, 4])
@pytest.mark.parametrize("method", ["allgather", "alltoall"])
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("hkv", [HQ, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ring_attention_matches_single_process_sdpa(world_size, method, is_causal, hkv, dtype):
    mesh = cp_mesh(world_size)
    q, k, v, dout = full_inputs(hkv, dtype, seed=world_size)
    expected = reference(q, k, v, dout, is_causal)
    with options(method):
        got = ring_run(mesh, q, k, v, dout, is_causal)
    pos = local_positions(mesh.get_local_rank(), world_size, S)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        assert g.dtype == dtype and g.shape == e.index_select(2, pos).shape, name
        torch.testing.assert_close(g.float(), e.index_select(2, pos), **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")


@distributed([2, 3])
@pytest.mark.parametrize("method", ["allgather", "alltoall"])
def test_contiguous_layout_without_load_balance_is_exact_too(world_size, method):
    mesh = cp_mesh(world_size)
    q, k, v, dout = full_inputs(2, torch.float32, seed=7, seq=3 * world_size)  # cp chunks, not 2*cp
    expected = reference(q, k, v, dout, True)
    with options(method, load_balance=False):
        got = ring_run(mesh, q, k, v, dout, True)
    pos = local_positions(mesh.get_local_rank(), world_size, q.size(2), load_balance=False)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e.index_select(2, pos), **TOL[torch.float32])


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("load_balance", [True, False])
def test_plan_computes_each_causal_pair_once_and_nothing_above_the_diagonal(cp, load_balance):
    seq = 4 * cp
    seen = torch.zeros(seq, seq, dtype=torch.int64)  # (query position, key position) computed
    work = []
    for rank in range(cp):
        qpos = local_positions(rank, cp, seq, load_balance=load_balance)
        pairs = 0
        for step in range(cp):
            kpos = local_positions((rank - step) % cp, cp, seq, load_balance=load_balance)
            for blk in ring_blocks(rank, cp, step, len(qpos), len(kpos), is_causal=True, load_balance=load_balance):
                qi, ki = qpos[blk.q], kpos[blk.k]
                mask = block_mask(blk, len(qi), len(ki))
                keep = torch.ones(len(qi), len(ki), dtype=torch.bool) if mask is None else ~mask
                assert keep.any(), (rank, step, blk)  # no block is computed only to be masked away
                seen[qi.unsqueeze(1).expand_as(keep)[keep], ki.unsqueeze(0).expand_as(keep)[keep]] += 1
                pairs += len(qi) * len(ki)
        work.append(pairs)
    assert torch.equal(seen, torch.tril(torch.ones(seq, seq, dtype=torch.int64)))
    c = seq // (2 * cp)
    if load_balance:  # every rank: chunks i and 2cp-1-i meet 2cp+1 chunk pairs, not 4cp
        assert work == [(2 * cp + 1) * c * c] * cp


@distributed([2, 4])
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
def test_blocks_above_the_diagonal_are_not_computed(world_size, is_causal):
    """Count the block kernel's score entries per rank: causal load-balanced does 2cp+1 chunk
    pairs (of c x c) forward and backward, full attention 4cp."""
    mesh = cp_mesh(world_size)
    counted = {"fwd": 0, "bwd": 0}

    def counting(kernel, key):
        def run(q, k, *args, **kwargs):
            counted[key] += q.size(-2) * k.size(-2)
            return kernel(q, k, *args, **kwargs)
        return run

    kernels = ring._block_forward, ring._block_backward
    ring._block_forward, ring._block_backward = counting(kernels[0], "fwd"), counting(kernels[1], "bwd")
    try:
        ring_run(mesh, *full_inputs(HQ, torch.float32), is_causal)
    finally:
        ring._block_forward, ring._block_backward = kernels
    c = S // (2 * world_size)
    pairs = 2 * world_size + 1 if is_causal else 4 * world_size
    assert counted == {"fwd": pairs * c * c, "bwd": pairs * c * c}


@distributed([2, 3])
@pytest.mark.parametrize("method", ["allgather", "alltoall"])
def test_collectives_per_attention_call_match_the_method(world_size, method):
    mesh = cp_mesh(world_size)
    n = world_size
    q, k, v, dout = (t.clone() for t in full_inputs(2, torch.float32))
    with options(method), context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2] * 4):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with CommDebugMode() as fwd:
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        with CommDebugMode() as bwd:
            out.backward(dout)
        kv_bytes = 2 * k.numel() * k.element_size()  # this rank's K and V, packed
    if method == "allgather":  # gather K/V once; backward gathers again and reduce-scatters dK/dV
        assert dict(fwd.get_comm_counts()) == {"all_gather": 1}
        assert dict(bwd.get_comm_counts()) == {"all_gather": 1, "reduce_scatter": 1}
    else:  # K/V passed cp-1 times; backward also carries the dK/dV accumulators cp times
        assert dict(fwd.get_comm_counts()) == {"send": n - 1, "recv": n - 1}
        assert dict(bwd.get_comm_counts()) == {"send": 2 * n - 1, "recv": 2 * n - 1}
        assert fwd.comm_bytes["send"] == (n - 1) * kv_bytes
        assert bwd.comm_bytes["send"] == (n - 1) * kv_bytes + n * kv_bytes  # fp32 grads of fp32 K/V


@distributed([2])
def test_buffers_are_sharded_in_place_and_restored_unless_asked(world_size):
    mesh = cp_mesh(world_size)
    module = torch.nn.Module()
    module.register_buffer("rope", torch.arange(8.0).repeat(3, 1).t().contiguous())  # (8, 3), seq dim 0
    tokens, labels = torch.arange(16).view(2, 8), torch.arange(16).view(2, 8) + 100
    rope, want_rope = module.rope, module.rope.clone()
    pos = local_positions(mesh.get_local_rank(), world_size, 8)  # rank 0: 0 1 6 7, rank 1: 2 3 4 5
    with context_parallel(mesh, buffers=[tokens, labels, module.rope], buffer_seq_dims=[1, 1, 0],
                          no_restore_buffers={labels}):
        assert module.rope is rope and rope.shape == (4, 3)  # the registered buffer itself
        assert torch.equal(tokens, torch.arange(16).view(2, 8)[:, pos]) and torch.equal(rope[:, 0], pos.float())
    assert torch.equal(tokens, torch.arange(16).view(2, 8)) and torch.equal(module.rope, want_rope)
    assert torch.equal(labels, (torch.arange(16).view(2, 8) + 100)[:, pos])  # left sharded
    assert torch.equal(context_parallel_unshard(mesh, [labels], [1])[0], torch.arange(16).view(2, 8) + 100)


@distributed([3])
@pytest.mark.parametrize("load_balance", [True, False])
def test_unshard_undoes_the_shard(world_size, load_balance):
    mesh = cp_mesh(world_size)
    x, y = torch.randn(2, 4, 12, 8), torch.randn(12, 5)
    comm.broadcast(x, src=0, group=mesh.get_group())  # the same full tensors on every rank
    comm.broadcast(y, src=0, group=mesh.get_group())
    xs, ys = x.clone(), y.clone()
    with options(load_balance=load_balance):
        with context_parallel(mesh, buffers=[xs, ys], buffer_seq_dims=[2, 0], no_restore_buffers={xs, ys}):
            pass
        assert xs.shape == (2, 4, 4, 8) and ys.shape == (4, 5)
        back = context_parallel_unshard(mesh, [xs, ys], [2, 0])
    assert torch.equal(back[0], x) and torch.equal(back[1], y)


@distributed([2])
def test_errors_name_the_numbers(world_size):
    mesh = cp_mesh(world_size)
    with pytest.raises(ValueError, match=r"length 10 does not split into 2\*cp = 4 chunks"):
        with context_parallel(mesh, buffers=[torch.zeros(1, 10)], buffer_seq_dims=[1]):
            pass
    with options(load_balance=False), pytest.raises(ValueError, match=r"length 9 does not split into cp = 2"):
        with context_parallel(mesh, buffers=[torch.zeros(1, 9)], buffer_seq_dims=[1]):
            pass
    with pytest.raises(ValueError, match=r"2 buffers but none sequence dims"):
        with context_parallel(mesh, buffers=[torch.zeros(8), torch.zeros(8)]):
            pass
    with pytest.raises(ValueError, match=r"buffer 0 of shape \(8,\) has no sequence dim 1"):
        with context_parallel(mesh, buffers=[torch.zeros(8)], buffer_seq_dims=[1]):
            pass
    with pytest.raises(ValueError, match=r"sequence lengths \[8, 16\]"):
        with context_parallel(mesh, buffers=[torch.zeros(8), torch.zeros(16)], buffer_seq_dims=[0, 0]):
            pass
    with pytest.raises(ValueError, match=r"one of \('allgather', 'alltoall'\), got 'ring'"):
        set_rotate_method("ring")
    q = torch.randn(1, 2, 4, 8)
    with context_parallel(mesh):
        with pytest.raises(ValueError, match=r"attn_mask of shape \(4, 4\)"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
        with pytest.raises(ValueError, match=r"dropout_p=0.1"):
            F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        with pytest.raises(ValueError, match=r"2 query heads and 1 key/value heads; pass enable_gqa=True"):
            F.scaled_dot_product_attention(q, q[:, :1], q[:, :1])
    two_d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))
    with pytest.raises(ValueError, match=r"1-D mesh .* got a 2-D mesh of shape \(1, 2\)"):
        with context_parallel(two_d):
            pass
    # outside the block SDPA is torch's own again
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q), torch.softmax(q @ q.mT / 8 ** 0.5, -1) @ q)


@distributed([4])
def test_dtensor_heads_sharded_over_tp_run_on_their_local_heads(world_size):
    """cp 2 x tp 2: q, k, v are DTensors with heads Shard(1) on mesh["tp"] (TP's local heads);
    the ring runs on each rank's heads and sequence chunks and hands back a DTensor."""
    from plait.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    q, k, v, dout = full_inputs(2, torch.float32, seed=11)
    expected = reference(q, k, v, dout, True)
    tp, heads = mesh.get_local_rank("tp"), slice(mesh.get_local_rank("tp") * 2, mesh.get_local_rank("tp") * 2 + 2)
    kv_heads = slice(tp, tp + 1)
    shards = [t.clone() for t in (q, k, v, dout)]
    with context_parallel(mesh["cp"], buffers=shards, buffer_seq_dims=[2] * 4, no_restore_buffers=set(shards)):
        leaves = [t[:, h].clone().requires_grad_() for t, h in zip(shards[:3], (heads, kv_heads, kv_heads))]
        dts = [DTensor.from_local(t, mesh["tp"], [Shard(1)]) for t in leaves]
        out = F.scaled_dot_product_attention(*dts, is_causal=True, enable_gqa=True)
        assert isinstance(out, DTensor) and out.placements == (Shard(1),)
        out.to_local().backward(shards[3][:, heads])
    pos = local_positions(mesh.get_local_rank("cp"), 2, S)
    for g, e, h in zip((out.to_local().detach(), *(t.grad for t in leaves)), expected,
                       (heads, heads, kv_heads, kv_heads)):
        torch.testing.assert_close(g, e.index_select(2, pos)[:, h], **TOL[torch.float32])


@distributed([2])
@pytest.mark.parametrize("door", ["imported_by_name", "checkpoint_recompute"])
def test_every_door_to_sdpa_leads_to_the_ring(world_size, door):
    """`from torch.nn.functional import scaled_dot_product_attention` (bound before the block:
    the function mode catches it), and a block recomputed in backward by activation
    checkpointing (no function mode is active there: F's patched name catches it)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa_by_name
    from torch.utils.checkpoint import checkpoint

    mesh = cp_mesh(world_size)
    q, k, v, dout = full_inputs(2, torch.float32, seed=5)
    expected = reference(q, k, v, dout, True)
    shards = [t.clone() for t in (q, k, v, dout)]
    with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2] * 4, no_restore_buffers=set(shards)):
        leaves = [t.clone().requires_grad_() for t in shards[:3]]
        if door == "imported_by_name":
            out = sdpa_by_name(*leaves, is_causal=True, enable_gqa=True)
        else:
            def attend(*qkv):
                return F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True)
            out = checkpoint(attend, *leaves, use_reentrant=False)
        out.backward(shards[3])
    pos = local_positions(mesh.get_local_rank(), world_size, S)
    for g, e in zip((out.detach(), *(t.grad for t in leaves)), expected):
        torch.testing.assert_close(g, e.index_select(2, pos), **TOL[torch.float32])
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # unpatched on exit


@distributed([3])
def test_p2p_ring_posts_the_next_transfer_before_computing_the_current_block(world_size):
    """Overlap, as an order of events: in forward each step's send/recv is issued before that
    step's blocks, and the last step (nothing left to fetch) issues none."""
    mesh = cp_mesh(world_size)
    log = []

    class Recorder(CommDebugMode):
        def on_start(self, event):
            super().on_start(event)
            log.append(event.op)

    kernel = ring._block_forward

    def block(*args, **kwargs):
        log.append("block")
        return kernel(*args, **kwargs)

    q, k, v, _ = (t.clone() for t in full_inputs(HQ, torch.float32))
    ring._block_forward = block
    try:
        with options("alltoall"), context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2] * 3):
            with Recorder():
                F.scaled_dot_product_attention(q, k, v, is_causal=False)
    finally:
        ring._block_forward = kernel
    assert log == ["send", "recv", "block"] * (world_size - 1) + ["block"]
