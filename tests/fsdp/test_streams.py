"""FSDP2's stream order, checked on CPU with the recording backend (plait.testing.streams):
one forward + backward of two sharded blocks under a root issues, for every all-gather,
the copy-in on its stream after that stream waited for compute, the all-gather on its own
after waiting for the copy-in, compute waiting for it before the copy-out and both gather
streams waiting for the copy-out; for every reduce-scatter, the collective on its stream
after that stream waited for compute, drained there, compute waiting for it before the
input is dropped and for the last grads at the end of backward. The grads equal the CPU
path's (no streams) exactly: the same ops run, only the stream calls are added."""

import torch
from torch import nn

from plait import comm
from plait.comm import device
from plait.device_mesh import init_device_mesh
from plait.fsdp import fully_shard
from plait.testing import distributed
from plait.testing.streams import RecordingStreams


def _step(rec: RecordingStreams | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    mesh = init_device_mesh("cpu", (comm.get_world_size(comm.world_group()),))
    if rec is None:
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        model(torch.randn(4, 5)).sum().backward()
        return [p.grad.to_local() for p in model.parameters()]
    with device.use_backend(rec):
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        with rec.listening():
            model(torch.randn(4, 5)).sum().backward()
    return [p.grad.to_local() for p in model.parameters()]


def _at(log: list[str], seq: list[str], start: int = 0) -> int:
    """Index of the first occurrence of `seq` as consecutive entries of log[start:]."""
    for i in range(start, len(log) - len(seq) + 1):
        if log[i:i + len(seq)] == seq:
            return i
    raise AssertionError(f"{seq} not in log from {start}:\n" + "\n".join(log[start:]))


@distributed([2])
def test_one_step_records_and_waits_in_torch_fsdp2_order():
    rec = RecordingStreams()
    grads = _step(rec)
    log = rec.log
    ops = [e for e in log if " on " in e]
    # the root holds no parameters of its own: forward gathers 0 and 2, backward again
    assert ops == ["all_gather on all_gather"] * 4 + ["reduce_scatter on reduce_scatter"] * 2, ops
    pos = 0
    for _ in range(4):  # each all-gather
        i = _at(log, ["all_gather_copy_in.wait_stream(default)", "enter all_gather_copy_in",
                      "exit all_gather_copy_in", "all_gather.wait_stream(all_gather_copy_in)",
                      "enter all_gather", "all_gather on all_gather"], pos)
        gathered = log[i + 6]
        assert gathered.startswith("all_gather.record("), gathered
        g = gathered[len("all_gather.record("):-1]
        j = _at(log, [f"default.wait({g})"], i)
        copied = log[j + 1]
        assert copied.startswith("default.record("), copied
        c = copied[len("default.record("):-1]
        assert log[j + 2:j + 4] == [f"all_gather_copy_in.wait({c})", f"all_gather.wait({c})"]
        pos = i + 1
    pos, drained, posts = 0, 0, []
    for _ in range(2):  # each reduce-scatter: issued, then drained on its stream
        i = _at(log, ["reduce_scatter.wait_stream(default)", "enter reduce_scatter",
                      "reduce_scatter on reduce_scatter", "exit reduce_scatter"], pos)
        j = next(k for k in range(max(i + 4, drained), len(log) - 1)  # its drain (after the next one is issued)
                 if log[k] == "enter reduce_scatter" and log[k + 1].startswith("reduce_scatter.record("))
        done, post = log[j + 1], log[j + 2]
        assert done.startswith("reduce_scatter.record(") and post.startswith("reduce_scatter.record("), log[j:]
        r, p = done[len("reduce_scatter.record("):-1], post[len("reduce_scatter.record("):-1]
        assert log[j + 3:j + 5] == ["exit reduce_scatter", f"default.wait({r})"], log[j:]
        posts.append(p)
        pos, drained = i + 1, j + 1
    assert log[-1] == f"default.wait({posts[-1]})", log[-3:]  # the optimizer reads the last grads after
    for got, want in zip(grads, _step(None)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
