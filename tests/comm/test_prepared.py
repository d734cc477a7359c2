"""A prepared all-reduce (the DDP reducer's per-bucket door) is the door's all-reduce, op for
op: the same result, the same per-group sequence numbers, the same event to every listener
(started at issue, ended at wait), the same counts in CommDebugMode, the same input checks."""

import dataclasses

import pytest
import torch

from plait import comm
from plait.debug import CommDebugMode
from plait.testing import distributed
from tests.comm.test_listeners import Recorder

# what differs between two ops by design: their place in the sequence, their times, annotations
_PER_OP = {"seq", "start_ns", "end_ns", "extra", "work"}


def _fields(event: comm.CommEvent) -> dict:
    return {f.name: getattr(event, f.name) for f in dataclasses.fields(event) if f.name not in _PER_OP}


@distributed([1, 2, 3])
def test_prepared_all_reduce_reports_and_reduces_as_the_door(world_size):
    g = comm.world_group()
    rank = comm.get_rank(g)
    buffer = torch.zeros(5)
    op = comm.prepare_all_reduce(buffer, group=g)
    rec = Recorder()
    with comm.listening(rec), CommDebugMode() as mode:
        for step in range(3):
            buffer.copy_(torch.arange(5.0) * (rank + 1) + step)
            assert op.start() is op
            assert len(rec.ended) == 2 * step, "the op ends when it is waited on"
            assert op.wait() is buffer
            reference = torch.arange(5.0) * (rank + 1) + step
            got = comm.all_reduce(reference, group=g, async_op=True).wait()
            torch.testing.assert_close(buffer, got, atol=0, rtol=0)
            assert op.wait() is buffer, "a second wait returns the result again"
    prepared, door = rec.started[0::2], rec.started[1::2]
    assert [_fields(e) for e in prepared] == [_fields(e) for e in door]
    assert _fields(prepared[0])["bytes_sent"] == int(2 * (world_size - 1) / world_size * 20)
    seqs = [e.seq for e in rec.started]
    assert seqs == list(range(seqs[0], seqs[0] + 6)), "one sequence counter with the door's ops"
    assert [e.seq for e in rec.ended] == seqs and all(e.completed and e.work is None for e in rec.ended)
    assert mode.get_comm_counts()["all_reduce"] == 6
    assert mode.get_total_bytes() == 6 * _fields(prepared[0])["bytes_sent"]


@distributed([2])
def test_prepared_all_reduce_checks_once_as_the_door_does():
    g = comm.world_group()
    with pytest.raises(ValueError, match="not contiguous"):
        comm.prepare_all_reduce(torch.zeros(4, 4).t(), group=g)
    with pytest.raises(TypeError, match="avg of torch.int64"):
        comm.prepare_all_reduce(torch.zeros(4, dtype=torch.int64), group=g, op="avg")
    with pytest.raises(ValueError, match="unknown reduce op"):
        comm.prepare_all_reduce(torch.zeros(4), group=g, op="median")
    assert comm.prepare_all_reduce(torch.ones(3), group=g).wait().tolist() == [1.0, 1.0, 1.0], \
        "a wait before any start returns the tensor untouched"


@distributed([1, 2, 3])
def test_prepared_broadcast_reports_and_copies_as_the_door(world_size):
    g = comm.world_group()
    rank = comm.get_rank(g)
    buffer = torch.zeros(2, 3, dtype=torch.int64)
    op = comm.prepare_broadcast(buffer, group=g)
    rec = Recorder()
    with comm.listening(rec), CommDebugMode() as mode:
        for src in range(world_size):
            buffer.fill_(10 * rank + src)
            assert op.run(src) is buffer
            assert buffer.eq(10 * src + src).all(), f"rank {rank} holds root {src}'s values"
            reference = torch.full((2, 3), 10 * rank + src, dtype=torch.int64)
            comm.broadcast(reference, src=src, group=g)
            torch.testing.assert_close(buffer, reference, atol=0, rtol=0)
    prepared, door = rec.started[0::2], rec.started[1::2]
    assert [_fields(e) for e in prepared] == [_fields(e) for e in door]
    assert [e.peer for e in prepared] == list(range(world_size))
    assert [e.bytes_sent for e in prepared] == [48 if rank == src else 0 for src in range(world_size)]
    seqs = [e.seq for e in rec.started]
    assert seqs == list(range(seqs[0], seqs[0] + 2 * world_size)), "one sequence counter with the door's ops"
    assert [e.seq for e in rec.ended] == seqs and all(e.completed and e.work is None for e in rec.ended)
    assert mode.get_comm_counts()["broadcast"] == 2 * world_size


@distributed([2])
def test_prepared_broadcast_checks_as_the_door_does():
    g = comm.world_group()
    with pytest.raises(ValueError, match="not contiguous"):
        comm.prepare_broadcast(torch.zeros(4, 4).t(), group=g)
    with pytest.raises(ValueError, match="not a rank of group"):
        comm.prepare_broadcast(torch.zeros(4), group=g).run(2)
    with pytest.raises(TypeError, match="plain torch.Tensor"):
        comm.prepare_broadcast(torch.nn.Parameter(torch.zeros(4)), group=g)
