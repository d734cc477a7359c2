"""DETAIL on a correct program: nothing raised, every result bit-identical to OFF, every op
(plait's and the script's own torch.distributed calls) traced, checked and recorded."""

import time

import torch
import torch.distributed as dist

from plait import comm, debug
from plait.debug import session
from plait.testing import distributed


def workload(seed: int) -> dict:
    """Every kind of op plait and a script issue, on the world group and a subgroup."""
    g = comm.world_group()
    n, rank = comm.get_world_size(g), comm.get_rank(g)
    torch.manual_seed(seed + rank)
    out = {}
    x = torch.randn(5, 3)
    comm.all_reduce(x, group=g)
    out["all_reduce"] = x
    out["all_gather_uneven"] = comm.all_gather(torch.randn(rank + 1, 2), group=g, sizes=[r + 1 for r in range(n)])
    out["reduce_scatter"] = comm.reduce_scatter(torch.randn(4 * n), group=g, op="avg")
    out["async"] = comm.all_reduce(torch.ones(3) * rank, group=g, async_op=True).wait()
    b = torch.randn(4)
    comm.broadcast(b, src=n - 1, group=g)
    out["broadcast"] = b
    out["all_to_all"] = comm.all_to_all(torch.arange(2.0 * n) + 10 * rank, group=g)
    right, left = (rank + 1) % n, (rank - 1) % n
    received = torch.empty(3)
    handles = comm.batch_isend_irecv([comm.P2POp("send", torch.full((3,), float(rank)), right, g),
                                      comm.P2POp("recv", received, left, g)])
    for h in handles:
        h.wait()
    out["ring"] = received
    pair = comm.new_group([rank - rank % 2, rank - rank % 2 + 1])
    y = torch.full((2,), float(rank))
    comm.all_reduce(y, group=pair)
    out["pair"] = y
    # the script's own calls, straight to torch.distributed
    m = torch.tensor([float(rank)])
    dist.all_reduce(m)
    out["user_all_reduce"] = m
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": rank})
    out["user_objects"] = torch.tensor([o["rank"] for o in objects])
    pieces = [torch.empty(2) for _ in range(n)]
    dist.all_gather(pieces, torch.full((2,), float(rank)))
    out["user_all_gather"] = torch.stack(pieces)
    got = torch.empty(2)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), float(rank)), right),
                                    dist.P2POp(dist.irecv, got, left)])
    for w in works:
        w.wait()
    out["user_ring"] = got
    dist.all_reduce(torch.ones(2), async_op=True).wait()
    dist.barrier()
    return out


@distributed([2, 4])
def test_detail_raises_nothing_and_changes_no_result(tmp_path):
    expected = workload(seed=7)
    with debug.configured(level="DETAIL", stacks=True, timeout=30, trace_dir=str(tmp_path)) as config:
        assert config.level == "DETAIL" and dist.all_reduce is not session.wrap._original(dist.all_reduce)
        recorder = session.session().recorder
        before = recorder.total
        got = workload(seed=7)
        totals = debug.summary()
        entries = recorder.entries()[before - recorder.total:]
    assert dist.all_reduce is session.wrap._original(dist.all_reduce), "configured() restores torch.distributed"
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    world = comm.world_group().group_name
    assert totals[world]["all_reduce"]["count"] >= 4  # plait's two, the script's two (+ the object gather's)
    assert totals[world]["send"]["count"] == 2 and totals[world]["recv"]["count"] == 2
    user = [e for e in entries if e.impl == "torch.distributed"]
    assert {e.op for e in user} >= {"all_reduce", "all_gather", "send", "recv", "barrier"}
    assert all(e.state == "completed" for e in entries), [(e.op, e.state) for e in entries if e.state != "completed"]
    assert all(e.site and e.site[0].endswith("test_detail.py") for e in entries), {e.site for e in entries}
    assert all(e.stack for e in entries)


@distributed([2])
def test_an_async_op_not_yet_waited_on_is_not_a_hang():
    """The watchdog sees the Work complete; it must not end the rank because nobody waited."""
    g = comm.world_group()
    # the op completes once both ranks issued it: they start together (the barrier), and the
    # timeout leaves room for a loaded machine to put a second between them
    timeout = 2.0
    comm.barrier(group=g)
    with debug.configured(level="DETAIL", timeout=timeout):
        handle = comm.all_reduce(torch.ones(4), group=g, async_op=True)
        time.sleep(timeout + 1.5)  # well past the timeout: a watchdog counting from issue would fire
        assert torch.equal(handle.wait(), torch.full((4,), 2.0))
        work = dist.all_reduce(torch.ones(2), async_op=True)
        time.sleep(timeout + 0.5)
        work.wait()
