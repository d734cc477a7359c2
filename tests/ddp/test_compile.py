"""torch.compile over data parallel: `torch.compile(DDP(mlp))` and `torch.compile(replicate(mlp))`
train like eager DDP, print no warning, break no graph inside the user's model, and still
overlap each bucket's all-reduce with the compiled backward.

What is measured, on 2 ranks, a 3-layer MLP (tests/ddp/common.py) with a bucket cap small
enough that each layer is a bucket of its own (and a piece of the split graph):

- graph breaks (torch._dynamo.utils.counters["graph_break"]): every break names plait's
  wrapper (DistributedDataParallel.forward, _Replicated.forward, ReplicaState.pre/post_forward), none the
  model, the model is one dynamo graph, and there are no more breaks than torch's own
  DDP gives for the same model in the same test;
- warnings (warnings.catch_warnings and the "torch" logger at WARNING): none;
- overlap: a counting backend logs each compiled backward piece as it runs, a
  plait.comm listener logs each all-reduce as it is issued: the graph is split in one
  piece per bucket, and every bucket but the last is issued before the backward of the
  pieces that hold earlier layers has run (compiled in one piece, all three all-reduces
  would come after its single backward);
- parity: losses each step and parameters at the end equal eager plait DDP on the same
  data, atol 1e-6 (float32; "aot_eager" runs the same aten ops eagerly, split or not, so
  only the order of a few additions can differ).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from plait import comm
from plait.ddp import DistributedDataParallel, replicate, replicate_state
from plait.testing import distributed
from tests.ddp.common import batch, build, loss_fn, mine, world
from tests.log_records import WarningRecords

STEPS = 3
CAP_MB = 100 / 2**20  # 100 bytes: each Linear (>= 156 bytes) closes a bucket of its own
TOL = dict(atol=1e-6, rtol=1e-6)
PLAIT_WRAPPERS = ("DistributedDataParallel.forward", "_Replicated.forward", "ReplicaState.pre_forward",
                  "ReplicaState.post_forward")


def _logging_backend(log: list) -> object:
    """aot_eager, noting in `log` when each compiled backward piece runs."""
    pieces = iter(range(100))

    def fw(gm, example_inputs):
        return make_boxed_func(gm.forward)

    def bw(gm, example_inputs):
        k = next(pieces)
        run = make_boxed_func(gm.forward)

        def logged(args):
            log.append(f"backward {k}")
            return run(args)

        logged._boxed_call = True
        return logged

    return aot_autograd(fw_compiler=fw, bw_compiler=bw)


class _AllReduces(comm.CommListener):
    def __init__(self, log: list) -> None:
        self.log = log

    def on_start(self, event: comm.CommEvent) -> None:
        if event.op == "all_reduce":
            self.log.append(f"all_reduce {event.input_shapes[0][0]}")


def _wrap(front: str, model: torch.nn.Module) -> torch.nn.Module:
    if front == "ddp":
        return DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    return replicate(model, bucket_cap_mb=CAP_MB)


def _train(model, run, opt, rank, log=None):
    losses = []
    for step in range(STEPS):
        x, y = batch("mlp", step, 2 * 3)
        loss = loss_fn("mlp", run(mine(x, rank)), mine(y, rank))
        if log is not None:
            log.append("backward starts")
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _compiled_run(front: str, rank: int, log: list):
    """Train a compiled replica; returns (model, losses, graph breaks, warnings, logs)."""
    torch._dynamo.reset()
    counters.clear()
    model = _wrap(front, build("mlp", seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handler = WarningRecords()
    torch_logger = logging.getLogger("torch")
    torch_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught, comm.listening(_AllReduces(log)):
            warnings.simplefilter("always")
            losses = _train(model, torch.compile(model, backend=_logging_backend(log)), opt, rank, log)
    finally:
        torch_logger.removeHandler(handler)
    breaks = dict(counters["graph_break"])
    graphs = counters["stats"]["unique_graphs"]
    return model, losses, breaks, graphs, [str(w.message) for w in caught], [r.getMessage() for r in handler.records]


def _torch_ddp_breaks() -> int:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    torch._dynamo.reset()
    counters.clear()
    ddp = TorchDDP(build("mlp", seed=0))
    compiled = torch.compile(ddp, backend="aot_eager")
    for step in range(STEPS):
        x, _ = batch("mlp", step, 3)
        compiled(x).sum().backward()
    return sum(counters["graph_break"].values())


@pytest.mark.parametrize("front", ["ddp", "replicate"])
@distributed([2])
def test_compiled_data_parallel_overlaps_without_breaks_in_the_model(front):
    _, rank, _ = world()
    log: list[str] = []
    model, losses, breaks, graphs, caught, logs = _compiled_run(front, rank, log)

    assert caught == [] and logs == [], f"warnings {caught}, log records {logs}"
    assert graphs == 1, f"the model is {graphs} dynamo graphs: a break inside it ({breaks})"
    for reason in breaks:
        assert any(name in reason for name in PLAIT_WRAPPERS), f"a graph break outside plait's wrapper: {reason}"
    ours, torchs = sum(breaks.values()), _torch_ddp_breaks()
    assert ours <= torchs, f"plait {front}: {ours} graph breaks, torch's DDP: {torchs}"

    # overlap, last step (buckets rebuilt in ready order): one backward piece per layer, and
    # between the backward of one piece and the next at least one bucket is issued
    last = log[len(log) - log[::-1].index("backward starts"):]
    pieces = [k for k, e in enumerate(last) if e.startswith("backward")]
    assert [last[k] for k in pieces] == ["backward 0", "backward 1", "backward 2"], last
    assert all(any(e.startswith("all_reduce") for e in last[a + 1:b]) for a, b in zip(pieces, pieces[1:])), last
    state = model._state if front == "ddp" else replicate_state(model)
    assert sum(e.startswith("all_reduce") for e in last) == len(state.reducer.buckets), last

    eager = _wrap(front, build("mlp", seed=0))
    eager_losses = _train(eager, eager, torch.optim.SGD(eager.parameters(), lr=0.1), rank)
    for step, (got, want) in enumerate(zip(losses, eager_losses)):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, s=step: f"step {s} loss: {m}")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL, msg=lambda m, n=name: f"{n}: {m}")

