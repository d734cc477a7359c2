"""DETAIL: planted mismatches are caught before anything is sent, on every rank, with the
ranks and the lines of this file; each rank's dump then lets the analyzer name the culprit.

Each fault runs on a fresh group (so the pool's default group stays in step) with a short
timeout; a fault that the check did not catch would hang and fail the test by timeout.
"""

import inspect

import pytest
import torch
import torch.distributed as dist

from plait import comm, debug
from plait.debug.analyze import analyze
from plait.testing import distributed

TIMEOUT_S = 20.0  # a missed mismatch hangs until the pool's own timeout: fail well before it


def _line(fn, marker: str) -> int:
    """Line number in this file of the line of `fn` that ends with `# <marker>`."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if text.rstrip().endswith(f"# {marker}"))


def _file_line(marker: str) -> int:
    """Line number in this file of the line that ends with `# <marker>`."""
    with open(__file__) as f:
        return next(n for n, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}"))


def _fault(fault, tmp_path, *, expect_kind: str, culprit: int | None, lines: dict[int, int]) -> None:
    """Run `fault(group, rank)` under DETAIL on every rank and check what each rank raises,
    then (on rank 0) what the analyzer makes of the dumps."""
    world = comm.world_group()
    n, rank = comm.get_world_size(world), comm.get_rank(world)
    group = dist.new_group(list(range(n)))  # fresh sequence numbers for this fault
    trace = tmp_path / "trace"
    with debug.configured(level="DETAIL", timeout=TIMEOUT_S, trace_dir=str(trace)):
        with pytest.raises(debug.CollectiveMismatchError) as caught:
            fault(group, rank)
    err = caught.value
    assert err.kind == expect_kind, str(err)
    message = str(err)
    for r, line in lines.items():
        assert f"rank {r}: " in message and f"test_check.py:{line} in" in message, message
    if culprit is not None:
        assert err.culprits == [culprit] and f"odd one out: global rank(s) [{culprit}]" in message, message
    comm.barrier(group=world)  # every rank has dumped
    if rank == 0:
        result = analyze(str(trace))  # the pool's ranks keep their history: look at this group
        problem = next((p for p in result.problems if p.group == group.group_name), None)
        assert problem is not None and problem.kind == expect_kind, result
        assert problem.culprits == ([culprit] if culprit is not None else []), problem
        sites = " ".join(str(s["site"]) for s in problem.sides)
        assert all(f"test_check.py:{line}" in sites for line in lines.values()), problem


def shape_differs(group, rank):
    n = 5 if rank == 1 else 4
    comm.all_reduce(torch.ones(n), group=group)  # all_reduce


def dtype_differs(group, rank):
    t = torch.ones(4, dtype=torch.float64 if rank == 2 else torch.float32)
    comm.all_reduce(t, group=group)  # all_reduce


def skips_one(group, rank):
    comm.all_reduce(torch.ones(2), group=group)
    if rank != 3:
        comm.all_reduce(torch.ones(2), group=group)  # skipped by rank 3
    comm.broadcast(torch.ones(2), src=0, group=group)  # rank 3 is here


def wrong_order(group, rank):
    x = torch.ones(4)
    if rank == 1:
        comm.all_gather(x, group=group)  # rank 1 first
        comm.all_reduce(x, group=group)
    else:
        comm.all_reduce(x, group=group)  # others first
        comm.all_gather(x, group=group)


@distributed([4])
def test_shape_differs_on_one_rank(tmp_path):
    line = _line(shape_differs, "all_reduce")
    _fault(shape_differs, tmp_path, expect_kind="size mismatch", culprit=1, lines={0: line, 1: line})


@distributed([4])
def test_dtype_differs_on_one_rank(tmp_path):
    line = _line(dtype_differs, "all_reduce")
    _fault(dtype_differs, tmp_path, expect_kind="dtype mismatch", culprit=2, lines={0: line, 2: line})


@distributed([4])
def test_rank_3_skips_a_collective(tmp_path):
    _fault(skips_one, tmp_path, expect_kind="op type mismatch", culprit=3,
           lines={0: _line(skips_one, "skipped by rank 3"), 3: _line(skips_one, "rank 3 is here")})


@distributed([2, 4])
def test_ops_in_a_different_order(tmp_path, world_size):
    culprit = 1 if world_size > 2 else None  # 1:1 cannot be judged: both sides are listed
    _fault(wrong_order, tmp_path, expect_kind="op type mismatch", culprit=culprit,
           lines={0: _line(wrong_order, "others first"), 1: _line(wrong_order, "rank 1 first")})


def users_all_reduce_against_plaits_broadcast(group, rank):
    t = torch.ones(3)
    if rank == 0:
        dist.all_reduce(t, group=group)  # user code through torch.distributed
    else:
        comm.broadcast(t, src=0, group=group)  # plait's own


@distributed([2])
def test_a_users_torch_distributed_call_is_checked_against_plaits_own(tmp_path):
    _fault(users_all_reduce_against_plaits_broadcast, tmp_path, expect_kind="op type mismatch", culprit=None,
           lines={0: _line(users_all_reduce_against_plaits_broadcast, "user code through torch.distributed"),
                  1: _line(users_all_reduce_against_plaits_broadcast, "plait's own")})


@distributed([2])
def test_a_send_and_its_recv_disagreeing_on_shape_is_caught_before_the_recv(tmp_path):
    g = dist.new_group([0, 1])
    rank = comm.get_rank(g)
    with debug.configured(level="DETAIL", timeout=TIMEOUT_S, trace_dir=str(tmp_path)):
        if rank == 0:
            handle = comm.isend(torch.ones(2, 3), dst=1, group=g)  # stage 0 sends
        comm.barrier(group=comm.world_group())  # the receiver comes second: it compares
        if rank == 1:
            with pytest.raises(debug.CollectiveMismatchError) as caught:
                comm.irecv(torch.empty(3, 2), src=0, group=g)  # stage 1 expects another shape
            message = str(caught.value)
            assert caught.value.kind == "size mismatch", message
            send_line, recv_line = _file_line("stage 0 sends"), _file_line("stage 1 expects another shape")
            assert f"rank 0: send (2, 3) float32  at tests/debug/test_check.py:{send_line}" in message, message
            assert f"rank 1: recv (3, 2) float32  at tests/debug/test_check.py:{recv_line}" in message, message
    if rank == 1:  # nothing was received: take the send now, so that the pool's ranks end in step
        comm.recv(torch.empty(2, 3), src=0, group=g)
    else:
        handle.wait()
