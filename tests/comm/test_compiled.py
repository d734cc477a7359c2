"""plait.comm called from torch.compile'd code: the door's bookkeeping is never traced. Each
eager collective is one clean graph break (the call runs eagerly, outside the graph), no
warning is printed, the result is the eager one, and the listeners count every op.

Before, dynamo traced into the door (CommEvent's clock, Handle's lock) and for the two
collectives below broke the graph 10 times and warned about `time.perf_counter_ns` and
`_thread.allocate_lock` on every rank. Collectives that belong inside a graph (DTensor's)
use the traceable door, tested in tests/tensor/test_compile_door.py.
"""

import warnings

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from plait import comm, debug
from plait.testing import distributed


@distributed([2])
def test_door_called_from_compiled_code_breaks_cleanly_without_warnings():
    g = comm.world_group()
    rank = comm.get_rank(g)

    def f(x):
        y = x * 2
        comm.all_reduce(y, group=g)
        z = comm.all_gather(y, group=g)
        return z + 1

    torch._dynamo.reset()
    counters.clear()
    x = torch.ones(3) * (rank + 1)
    with warnings.catch_warnings(record=True) as caught, debug.CommDebugMode() as mode:
        warnings.simplefilter("always")
        out = torch.compile(f, backend="aot_eager")(x)
    assert [str(w.message) for w in caught] == []
    torch.testing.assert_close(out, f(x))  # (1 + 2) * 2 + 1 everywhere
    assert dict(mode.get_comm_counts()) == {"all_reduce": 1, "all_gather": 1}
    breaks = counters["graph_break"]
    assert sum(breaks.values()) <= 3, dict(breaks)  # one per eager collective (+ its resume)
    assert all("marked as skipped" in reason for reason in breaks), list(breaks)


@distributed([2])
def test_detail_stops_a_mismatched_compiled_collective_before_it_is_sent(tmp_path):
    """The traceable door (plait.comm.functional, what DTensor's graphs use) is checked like
    the eager one: under DETAIL, rank 0's compiled all-reduce meeting rank 1's compiled
    all-gather raises CollectiveMismatchError on both ranks from inside the graphs, nothing
    is sent, and the group works on afterwards."""
    from plait.comm import functional
    from plait.debug import CollectiveMismatchError

    g = comm.world_group()
    rank = comm.get_rank(g)

    def reduce(x):
        return functional.all_reduce(x * 2, g, "sum")

    def gather(x):
        return functional.all_gather(x * 2, g, 0, [3, 3])

    torch._dynamo.reset()
    mismatched = torch.compile(reduce if rank == 0 else gather, backend="aot_eager", fullgraph=True)
    with debug.configured(level="DETAIL", trace_dir=str(tmp_path)):
        try:
            mismatched(torch.ones(3))
        except CollectiveMismatchError as e:
            error = str(e)
        else:
            raise AssertionError("the mismatch was not caught")
        assert "all_reduce" in error and "all_gather" in error, error
        out = torch.compile(reduce, backend="aot_eager", fullgraph=True)(torch.ones(3))
    torch.testing.assert_close(out, torch.full((3,), 4.0))
