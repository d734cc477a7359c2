"""The pipeline runtime's stream order, checked on CPU with the recording backend: in one
1F1B step every send and receive is issued on the p2p stream right after that stream waited
for compute; every receive a compute reads is waited on p2p, then compute waits for an
event recorded there after it; the step ends with compute waiting for the sends. Losses and
grads equal the CPU path's (no streams) exactly."""

import contextlib

import torch
from torch import nn

from plait import comm
from plait.comm import device
from plait.pipelining import PipelineStage, Schedule1F1B
from plait.testing import distributed
from plait.testing.streams import RecordingStreams


def _two_steps(rec: RecordingStreams | None):
    rank = comm.get_rank(comm.world_group())
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    m = 4
    x, y = torch.randn(2 * m, 4), torch.randn(2 * m, 4)
    args = (x,) if rank == 0 else ()
    target = y if rank == 1 else None
    losses: list = []
    with device.use_backend(rec) if rec is not None else contextlib.nullcontext():
        stage = PipelineStage(layers[rank], rank, 2, "cpu")
        schedule = Schedule1F1B(stage, m, loss_fn=nn.functional.mse_loss)
        schedule.step(*args, target=target)  # the first step exchanges shapes
        if rec is not None:
            rec.log.clear()
            with rec.listening():
                schedule.step(*args, target=target, losses=losses)
        else:
            schedule.step(*args, target=target, losses=losses)
    return losses, [p.grad.clone() for p in layers[rank].parameters()]


@distributed([2])
def test_one_step_posts_on_p2p_and_compute_waits_for_receives():
    rec = RecordingStreams()
    losses, grads = _two_steps(rec)
    log = rec.log
    ops = [i for i, e in enumerate(log) if e in ("send on p2p", "recv on p2p")]
    assert ops and all(" on " not in e or e.endswith(" on p2p") for e in log), log
    assert len(ops) == 4 * 2, log  # 4 microbatches: an activation one way, a grad back
    for i in ops:  # each batch: p2p waits for compute, then posts on p2p
        k = i
        while log[k - 1] in ("send on p2p", "recv on p2p"):
            k -= 1
        assert log[k - 2:k] == ["p2p.wait_stream(default)", "enter p2p"], log[k - 3:i + 1]
    recorded = [e[len("p2p.record("):-1] for e in log if e.startswith("p2p.record(")]
    waited = [e[len("default.wait("):-1] for e in log if e.startswith("default.wait(")]
    assert recorded == waited and recorded, (recorded, waited)  # compute waits for every one, in order
    for j, e in enumerate(log):
        if e.startswith("p2p.record("):
            assert log[j - 1] == "enter p2p" and log[j + 1:j + 3] == ["exit p2p", f"default.wait({e[11:-1]})"]
    assert log[-1].startswith("default.wait("), log[-3:]  # the sends, at the end of the step
    want_losses, want_grads = _two_steps(None)
    for got, want in zip(losses + grads, want_losses + want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
