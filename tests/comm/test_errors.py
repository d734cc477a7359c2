"""Bad input is refused on the rank that made it, before anything is sent, with the numbers."""

import pytest
import torch

from plait import comm
from plait.testing import distributed


def _raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


@distributed([2])
def test_bad_calls_raise_before_sending():
    g = comm.world_group()
    rank = comm.get_rank(g)
    _raises(TypeError, "must be a torch.distributed.ProcessGroup", comm.all_reduce, torch.ones(2), group="world")
    _raises(TypeError, "must be a torch.Tensor", comm.all_reduce, [1.0], group=g)
    _raises(ValueError, "not contiguous and this op writes into it", comm.all_reduce, torch.ones(4, 4).t(), group=g)
    _raises(ValueError, "not contiguous", comm.broadcast, torch.ones(4, 4)[:, ::2], src=0, group=g)
    _raises(ValueError, "unknown reduce op", comm.all_reduce, torch.ones(2), group=g, op="mean")
    _raises(TypeError, "avg of torch.int64", comm.all_reduce, torch.ones(2, dtype=torch.int64), group=g, op="avg")
    _raises(TypeError, "cannot reduce torch.int16", comm.all_reduce, torch.ones(2, dtype=torch.int16), group=g)
    _raises(ValueError, r"sizes\[.\] = 5 but this rank's tensor has 3", comm.all_gather, torch.ones(3), group=g, sizes=[5, 5])
    _raises(ValueError, "has 3 entries but the group has 2 ranks", comm.all_gather, torch.ones(3), group=g, sizes=[3, 3, 3])
    _raises(ValueError, r"\[2, 3\] add up to 5, not 4", comm.reduce_scatter, torch.ones(4), group=g, sizes=[2, 3])
    _raises(ValueError, "5 is not divisible by the group size 2; pass sizes=", comm.reduce_scatter, torch.ones(5), group=g)
    _raises(ValueError, "0-dim tensor", comm.all_gather, torch.tensor(1.0), group=g)
    _raises(ValueError, "dim 2 is out of range", comm.all_gather, torch.ones(2, 2), group=g, dim=2)
    _raises(ValueError, "out= has shape", comm.all_gather, torch.ones(2), group=g, out=torch.empty(3))
    _raises(ValueError, "both output_split_sizes and input_split_sizes", comm.all_to_all, torch.ones(4), group=g, input_split_sizes=[2, 2])
    _raises(ValueError, "3 is not divisible by 2", comm.all_to_all, torch.ones(3), group=g)
    _raises(ValueError, "src 2 is not a rank of group", comm.broadcast, torch.ones(2), src=2, group=g)
    _raises(ValueError, "this rank itself", comm.send, torch.ones(2), dst=rank, group=g)
    _raises(ValueError, "dst 7 is not a rank", comm.isend, torch.ones(2), dst=7, group=g)
    _raises(ValueError, "P2POp kind must be", comm.P2POp, "put", torch.ones(1), 0, g)
    _raises(ValueError, r"global rank \d asked for group \[5\]|not in \[0, world_size 2\)", comm.new_group, [5])
    _raises(RuntimeError, "already initialized", comm.init_process_group, "gloo")
    # Nothing above reached the wire: the group still works, in step on both ranks.
    t = torch.ones(1)
    comm.all_reduce(t, group=g)
    assert t.item() == 2


def test_init_names_what_is_missing(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE not set; start the script with `plait run`"):
        comm.init_process_group("gloo")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT not set"):
        comm.init_process_group("gloo")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"rank 3 is not in \[0, world_size 2\)"):
        comm.init_process_group("gloo")


def test_algorithm_overrides_are_checked(monkeypatch):
    from plait.comm import algorithms

    with pytest.raises(ValueError, match="unknown implementation 'ring'"):
        comm.set_algorithm("all_gather", "ring")
    assert algorithms.choose("all_gather", "gloo", 1 << 10) == "native"
    assert algorithms.choose("all_gather", "gloo", 64 << 20) == "all_reduce"
    assert algorithms.choose("all_gather", "nccl", 64 << 20) == "native"
    comm.set_algorithm("all_gather", "native")
    assert algorithms.choose("all_gather", "gloo", 64 << 20) == "native"
    comm.set_algorithm("all_gather", None)
    monkeypatch.setenv("PLAIT_COMM_ALGORITHMS", "reduce_scatter=native")
    assert algorithms._parse_env() == {"reduce_scatter": "native"}
    monkeypatch.setenv("PLAIT_COMM_ALGORITHMS", "scatter=native")
    with pytest.raises(ValueError, match="PLAIT_COMM_ALGORITHMS: unknown op 'scatter'"):
        algorithms._parse_env()
