"""Every op reports to the listeners: sequence numbers, shapes, bytes by the ring model."""

import torch

from plait import comm
from plait.debug import CommDebugMode
from plait.testing import distributed


class Recorder(comm.CommListener):
    def __init__(self):
        self.started, self.ended = [], []

    def on_start(self, event):
        self.started.append(event)

    def on_end(self, event):
        self.ended.append(event)


@distributed([1, 2, 4])
def test_events_carry_seq_shapes_and_bytes(world_size):
    g = comm.world_group()
    n = world_size
    rec = Recorder()
    with comm.listening(rec):
        comm.all_reduce(torch.ones(8), group=g)
        h = comm.all_gather(torch.ones(4, 2), group=g, async_op=True)
        assert len(rec.ended) == (1 if n > 1 else 2), "an async op ends when it is waited on"
        h.wait()
        comm.reduce_scatter(torch.ones(4 * n), group=g)
        comm.barrier(group=g)
    assert comm.listeners() == ()
    ops = [e.op for e in rec.started]
    assert ops == ["all_reduce", "all_gather", "reduce_scatter", "barrier"]
    assert [e.op for e in rec.ended] == ops and all(e.completed for e in rec.ended)
    seqs = [e.seq for e in rec.started]
    assert seqs == list(range(seqs[0], seqs[0] + 4)), "seq counts every op on the group"
    ar, ag, rs, _ = rec.started
    assert ar.bytes_sent == int(2 * (n - 1) / n * 32)
    assert ag.output_shapes == ((4 * n, 2),) and ag.input_dtypes == (torch.float32,) and ag.async_op
    expected_ag = (n - 1) * 32 if ag.impl == "native" else int(2 * (n - 1) / n * 32 * n)
    assert ag.bytes_sent == expected_ag
    assert rs.reduce_op == "sum" and rs.group_ranks == tuple(range(n))


@distributed([2, 3])
def test_comm_debug_mode_counts_by_op():
    g = comm.world_group()
    with CommDebugMode() as mode:
        for _ in range(3):
            comm.all_reduce(torch.ones(4), group=g)
        comm.all_gather(torch.ones(2), group=g)
        comm.autograd.all_gather(torch.ones(2, requires_grad=True), group=g).sum().backward()
    counts = mode.get_comm_counts()
    assert counts[comm.all_reduce] == 3 and counts["all_reduce"] == 3
    assert counts["all_gather"] == 2 and counts["reduce_scatter"] == 1
    assert mode.get_total_counts() == 6
    assert mode.get_total_bytes() == sum(mode.get_comm_bytes().values()) > 0
