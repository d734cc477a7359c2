"""Every collective of plait.comm against the math, on 1, 2, 3, 4 and 8 ranks.

Inputs are built from a seed every rank knows, so each rank can compute the expected
result of the whole group locally. Comparisons are exact: data movement is bit-exact and
the sums here are of small integers, exact in every dtype tested (bf16 included).
"""

import pytest
import torch

from plait import comm
from plait.testing import distributed

WORLD_SIZES = [1, 2, 3, 4, 8]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _group():
    g = comm.world_group()
    return g, comm.get_rank(g), comm.get_world_size(g)


def _input(rank, shape, dtype, salt=0):
    """Small integers, exactly representable in every dtype tested; different per rank."""
    gen = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-8, 8, shape, generator=gen).to(dtype)


def _wait(x, async_op):
    return x.wait() if async_op else x


@distributed(WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce(dtype, async_op):
    g, rank, n = _group()
    xs = [_input(r, (5, 3), dtype) for r in range(n)]
    for op, expected in [
        ("sum", torch.stack(xs).sum(0)),
        ("max", torch.stack(xs).amax(0)),
        ("min", torch.stack(xs).amin(0)),
        ("product", torch.stack([x.clamp(-1, 2) for x in xs]).prod(0)),
    ]:
        t = xs[rank].clone() if op != "product" else xs[rank].clamp(-1, 2)
        out = _wait(comm.all_reduce(t, group=g, op=op, async_op=async_op), async_op)
        assert out is t
        torch.testing.assert_close(t, expected.to(dtype), rtol=0, atol=0, msg=op)
    if dtype.is_floating_point:
        t = xs[rank].clone()
        comm.all_reduce(t, group=g, op="avg")
        torch.testing.assert_close(t, (torch.stack(xs).double().sum(0) / n).to(dtype))


@distributed(WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["native", "all_reduce"])
@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_even_and_uneven(dtype, impl, dim):
    g, rank, n = _group()
    comm.set_algorithm("all_gather", impl)
    for sizes in ([3] * n, [(r % 3) for r in range(n)]):  # uneven includes empty pieces
        xs = [_input(r, (sizes[r], 4) if dim == 0 else (4, sizes[r]), dtype, salt=1) for r in range(n)]
        expected = torch.cat(xs, dim=dim)
        for async_op in (False, True):
            got = _wait(comm.all_gather(xs[rank], group=g, dim=dim, sizes=sizes, async_op=async_op), async_op)
            assert torch.equal(got, expected), (sizes, async_op)
        out = torch.empty_like(expected)
        assert comm.all_gather(xs[rank], group=g, dim=dim, sizes=sizes, out=out) is out
        assert torch.equal(out, expected)


@distributed([2, 3])
def test_all_gather_is_bit_exact_for_special_floats():
    g, rank, n = _group()
    comm.set_algorithm("all_gather", "all_reduce")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1e-38, rank + 0.5], dtype=dtype)
        got = comm.all_gather(x, group=g)
        for r in range(n):
            piece = got[r * 6:(r + 1) * 6]
            mine = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1e-38, r + 0.5], dtype=dtype)
            assert torch.equal(piece.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                               mine.view(torch.int16 if dtype.itemsize == 2 else torch.int32)), dtype


@distributed(WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["native", "all_reduce"])
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter_even_and_uneven(dtype, impl, dim):
    g, rank, n = _group()
    comm.set_algorithm("reduce_scatter", impl)
    for sizes in ([2] * n, [(r % 3) for r in range(n)]):
        total = sum(sizes)
        shape = (total, 3) if dim == 0 else (3, total)
        xs = [_input(r, shape, dtype, salt=2) for r in range(n)]
        full = torch.stack(xs).sum(0).to(dtype)
        offset = sum(sizes[:rank])
        expected = full.narrow(dim, offset, sizes[rank])
        for async_op in (False, True):
            x = xs[rank].clone()
            got = _wait(comm.reduce_scatter(x, group=g, dim=dim, sizes=sizes, async_op=async_op), async_op)
            assert torch.equal(got, expected), (sizes, async_op)
            assert torch.equal(x, xs[rank]), "the input must be left unchanged"
        if dtype.is_floating_point:
            got = comm.reduce_scatter(xs[rank], group=g, op="max", dim=dim, sizes=sizes)
            assert torch.equal(got, torch.stack(xs).amax(0).narrow(dim, offset, sizes[rank]))
            got = comm.reduce_scatter(xs[rank], group=g, op="avg", dim=dim, sizes=sizes)
            torch.testing.assert_close(got, (torch.stack(xs).double().sum(0) / n).to(dtype).narrow(dim, offset, sizes[rank]))


@distributed(WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.int16])
def test_broadcast(dtype):
    g, rank, n = _group()
    for src in {0, n - 1}:
        t = _input(rank, (4, 2), dtype, salt=3)
        h = comm.broadcast(t, src=src, group=g, async_op=True)
        assert h.wait() is t
        assert torch.equal(t, _input(src, (4, 2), dtype, salt=3))


@distributed(WORLD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.int16])
def test_all_to_all_even_and_uneven(dtype):
    g, rank, n = _group()
    # rank r sends (r + k) % 3 rows to rank k
    split = lambda src, dst: (src + dst) % 3  # noqa: E731
    xs = [_input(r, (sum(split(r, k) for k in range(n)), 2), dtype, salt=4) for r in range(n)]

    def piece(src, dst):
        start = sum(split(src, k) for k in range(dst))
        return xs[src][start:start + split(src, dst)]

    in_splits = [split(rank, k) for k in range(n)]
    out_splits = [split(k, rank) for k in range(n)]
    got = comm.all_to_all(xs[rank], group=g, input_split_sizes=in_splits, output_split_sizes=out_splits)
    assert torch.equal(got, torch.cat([piece(k, rank) for k in range(n)]))
    even = [_input(r, (2 * n, 3), dtype, salt=5) for r in range(n)]
    got = comm.all_to_all(even[rank], group=g, async_op=True).wait()
    assert torch.equal(got, torch.cat([even[k][2 * rank:2 * rank + 2] for k in range(n)]))


@distributed(WORLD_SIZES)
def test_reduce_and_barrier():
    g, rank, n = _group()
    for dst in {0, n - 1}:
        t = torch.full((3,), float(rank + 1))
        comm.reduce(t, dst=dst, group=g)
        if rank == dst:
            assert torch.equal(t, torch.full((3,), float(n * (n + 1) // 2)))
    comm.barrier(group=g)
    comm.barrier(group=g, async_op=True).wait()


@distributed([2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES + [torch.int16])
def test_send_recv_ring_and_batched(dtype):
    g, rank, n = _group()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    mine = _input(rank, (3, 2), dtype, salt=6)
    inbox = torch.empty_like(mine)
    if rank % 2 == 0:
        comm.send(mine, dst=nxt, group=g)
        comm.recv(inbox, src=prv, group=g)
    else:
        comm.recv(inbox, src=prv, group=g)
        comm.send(mine, dst=nxt, group=g)
    assert torch.equal(inbox, _input(prv, (3, 2), dtype, salt=6))
    inbox = torch.empty_like(mine)
    handles = comm.batch_isend_irecv([
        comm.P2POp("send", mine, nxt, g),
        comm.P2POp(comm.irecv, inbox, prv, g),
    ])
    results = [h.wait() for h in handles]
    assert results[1] is inbox and torch.equal(inbox, _input(prv, (3, 2), dtype, salt=6))
    h_send = comm.isend(mine * 2, dst=nxt, group=g)
    got = comm.irecv(torch.empty_like(mine), src=prv, group=g).wait()
    h_send.wait()
    assert torch.equal(got, _input(prv, (3, 2), dtype, salt=6) * 2)


@distributed([4])
def test_subgroups_are_cached_and_work():
    g, rank, n = _group()
    evens = [0, 2] if rank % 2 == 0 else [1, 3]
    sub = comm.new_group(evens)
    assert comm.new_group(list(reversed(evens))) is sub, "one group per rank set"
    assert comm.get_world_size(sub) == 2 and comm.get_rank(sub) == evens.index(rank)
    t = torch.tensor([float(rank)])
    comm.all_reduce(t, group=sub)
    assert t.item() == sum(evens)
    assert comm.new_group(range(n)) is g
