"""Shapes are inferred once, checked ever after; user mistakes fail early with the numbers.

An error a rank detects is raised there before that rank sends anything for the step. Its
peers, which cannot know, would wait on it (as with torch, until the process group times
out), so each error test runs the failing call only on the rank that detects it, and only
where nothing of the step is in flight, leaving the pool clean for the next test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    StageModule,
)
from plait.pipelining.meta import TensorMeta
from plait.testing import distributed

from .test_runtime_parity import Dense, Fork, Join, Uneven


def _rank():
    g = comm.world_group()
    return comm.get_rank(g), comm.get_world_size(g)


class _P2PCounter(comm.CommListener):
    def __init__(self):
        self.sends: list[tuple[torch.dtype, tuple]] = []

    def on_start(self, event):
        if event.op == "send":
            self.sends.append((event.input_dtypes[0], event.input_shapes[0]))


# Uneven's units, cut in 4 stages; a tuple (40 and 3 wide) crosses the boundary after stage 0.
FOUR = [
    lambda: StageModule([("inp", Dense(6, 24)), ("fork", Fork(24, 40, 3))]),
    lambda: StageModule([("join", Join(40, 3, 64)), ("narrow", Dense(64, 8))]),
    lambda: StageModule([("wide.0", Dense(8, 96)), ("wide.1", Dense(96, 96))]),
    lambda: StageModule([("squeeze", Dense(96, 5)), ("out", nn.Linear(5, 4))]),
]
INPUTS = [((2, 6),), ((2, 40), (2, 3)), ((2, 8),), ((2, 96),)]
OUTPUTS = [((2, 40), (2, 3)), ((2, 8),), ((2, 96),), ((2, 4),)]


@distributed([2])
@pytest.mark.parametrize("give_args", [False, True])
def test_shapes_are_inferred_at_the_first_step_and_exchanged_once(give_args):
    rank, _ = _rank()
    owned = [rank, 3 - rank]  # V placement: rank 0 has stages 0 and 3
    stages = []
    for s in owned:
        kw = {}
        if give_args:
            kw = {
                "input_args": tuple(torch.zeros(sh) for sh in INPUTS[s]),
                "output_args": tuple(torch.zeros(sh) for sh in OUTPUTS[s]),
            }
        stages.append(PipelineStage(FOUR[s](), s, 4, "cpu", **kw))
    schedule = ScheduleZBVZeroBubble(stages, 4, loss_fn=F.mse_loss)
    counter = _P2PCounter()
    comm.add_listener(counter)
    for step in range(2):
        counter.sends.clear()
        x, y = torch.randn(8, 6), torch.randn(8, 4)
        schedule.step(*((x,) if rank == 0 else ()), target=y if rank == 0 else None)
        metadata = [s for s in counter.sends if s[0] == torch.int64]
        # step 0: rank 0 tells stage 1 its 2 input shapes; rank 1 tells stage 3 its 1
        assert len(metadata) == (2 if step == 0 else 0), (step, metadata)
        assert len(counter.sends) - len(metadata) == (2 * 4 + 1 * 4 if rank == 0 else 1 * 4 + 2 * 4)
    for stage, s in zip(stages, owned):
        assert stage.inputs_meta == tuple(TensorMeta(sh, torch.float32) for sh in INPUTS[s])
        assert stage.outputs_meta == tuple(TensorMeta(sh, torch.float32) for sh in OUTPUTS[s])


@distributed([2])
def test_input_and_output_args_that_disagree_are_named():
    rank, _ = _rank()
    if rank != 0:
        return  # the error is raised on rank 0 before it sends anything
    wrong_in = PipelineStage(FOUR[0](), 0, 2, "cpu", input_args=torch.zeros(3, 6))
    with pytest.raises(
        ValueError,
        match=r"stage 0: input_args tensor 0 has shape \(3, 6\) "
        r"float32, but the microbatches it receives had \(2, 6\)",
    ):
        Schedule1F1B(wrong_in, 4, loss_fn=F.mse_loss).step(torch.randn(8, 6))
    wrong_out = PipelineStage(FOUR[0](), 0, 2, "cpu", output_args=(torch.zeros(2, 40),))
    with pytest.raises(
        ValueError,
        match=r"stage 0: output_args tensors: 1 tensors, but its "
        r"forward had 2",
    ):
        Schedule1F1B(wrong_out, 4, loss_fn=F.mse_loss).step(torch.randn(8, 6))


@distributed([2])
def test_a_later_batch_of_another_shape_is_an_error_naming_stage_microbatch_and_shapes():
    rank, _ = _rank()
    stage = PipelineStage(nn.Linear(6, 6) if rank == 0 else nn.Linear(6, 4), rank, 2, "cpu")
    schedule = Schedule1F1B(stage, 4, loss_fn=F.mse_loss)
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    schedule.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
    if rank == 0:  # rank 1 does not know the batch changed: it is not asked to wait for it
        with pytest.raises(
            ValueError,
            match=r"stage 0, microbatch 0: input 0 has shape \(4, 6\) "
            r"float32, but the first step's microbatches had \(2, 6\)",
        ):
            schedule.step(torch.randn(16, 6))


class _Grows(nn.Module):
    """Widens its output from the microbatch whose first value is negative on."""

    def forward(self, x):
        return torch.cat([x, x], dim=-1) if x[0, 0] < 0 else x


@distributed([1])
def test_an_output_shape_that_changes_mid_step_is_named_with_its_microbatch():
    # one rank, two stages: the handover is local, so nothing is in flight when it fails
    stages = [PipelineStage(_Grows(), 0, 2, "cpu"), PipelineStage(nn.Linear(4, 1), 1, 2, "cpu")]
    schedule = ScheduleLoopedBFS(stages, 4, loss_fn=F.mse_loss, scale_grads=False)
    x = torch.ones(8, 4)
    schedule.step(x, target=torch.zeros(8, 1))
    x[4, 0] = -1  # microbatch 2 (rows 4 and 5)
    with pytest.raises(
        ValueError,
        match=r"stage 0, microbatch 2: output 0 has shape \(2, 8\) float32, "
        r"but the first step \(receive buffers are sized from it\) "
        r"had \(2, 4\) float32",
    ):
        schedule.step(x, target=torch.zeros(8, 1))


@distributed([2])
def test_a_batch_not_divisible_by_n_microbatches_fails_where_it_is_given():
    rank, _ = _rank()
    stage = PipelineStage(nn.Linear(6, 6) if rank == 0 else nn.Linear(6, 4), rank, 2, "cpu")
    schedule = ScheduleGPipe(stage, 4, loss_fn=F.mse_loss)
    what = "args\\[0\\]" if rank == 0 else "target"
    with pytest.raises(
        ValueError, match=f"{what}: batch size 10 .* not divisible by n_microbatches 4"
    ):
        if rank == 0:
            schedule.step(torch.randn(10, 6))
        else:
            schedule.step(target=torch.randn(10, 4))


@distributed([2])
def test_eval_runs_forward_only_and_returns_outputs_and_losses():
    rank, _ = _rank()
    torch.manual_seed(0)
    model = Uneven()
    cut = {0: ["inp", "fork", "join", "narrow"], 1: ["wide.0", "wide.1", "squeeze", "out"]}
    parts = dict(model.named_modules())
    stage = PipelineStage(StageModule([(n, parts[n]) for n in cut[rank]]), rank, 2, "cpu")
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    trained = Schedule1F1B(stage, 4, loss_fn=F.mse_loss)
    losses: list[torch.Tensor] = []
    out = trained.eval(*((x,) if rank == 0 else ()), target=y if rank == 1 else None, losses=losses)
    assert all(p.grad is None for p in model.parameters()), "eval must not run backward"
    no_loss = Schedule1F1B(stage, 4)  # without loss_fn, step() is forward only too
    out2 = no_loss.step(*((x,) if rank == 0 else ()))
    if rank == 1:
        with torch.no_grad():
            want = model(x)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(out2, want)
        torch.testing.assert_close(
            torch.stack(losses),
            torch.stack([F.mse_loss(want[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)]),
        )
    else:
        assert out is None and losses == []


@distributed([2])
def test_wrong_stages_for_a_schedule_are_named_at_construction():
    rank, p = _rank()
    one = PipelineStage(nn.Linear(2, 2), rank, 4, "cpu")
    with pytest.raises(ValueError, match=r"one stage per rank: num_stages\(4\) != group size\(2\)"):
        Schedule1F1B(one, 4)
    pair = [PipelineStage(nn.Linear(2, 2), s, 4, "cpu") for s in (2 * rank, 2 * rank + 1)]
    with pytest.raises(
        ValueError,
        match=rf"rank {rank} was given stages \[{2 * rank}, {2 * rank + 1}\], "
        rf"but Interleaved1F1B places stages \[{rank}, {rank + 2}\]",
    ):
        ScheduleInterleaved1F1B(pair, 4)
    with pytest.raises(
        ValueError, match="ScheduleZBVZeroBubble needs exactly 2 stages per rank, got 1"
    ):
        ScheduleZBVZeroBubble(pair[:1], 4)
    if rank == 1:
        stage = PipelineStage(nn.Linear(2, 2), 1, 2, "cpu")
        with pytest.raises(ValueError, match="runs the last stage.*pass target="):
            Schedule1F1B(stage, 2, loss_fn=F.mse_loss).step()
        with torch.no_grad(), pytest.raises(RuntimeError, match="grad enabled, or use eval"):
            Schedule1F1B(stage, 2, loss_fn=F.mse_loss).step(target=torch.zeros(2, 2))


class _WithMask(nn.Module):
    """Passes an int64 mask and a float activation to the next stage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x), (x[:, :1] > 0).long()


class _UseMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, h, mask):
        return self.lin(h) * mask


@distributed([2])
def test_a_non_differentiable_tensor_crosses_without_a_gradient():
    rank, _ = _rank()
    torch.manual_seed(0)
    parts = [_WithMask(), _UseMask()]
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    ref = [type(p)() for p in parts]  # the whole model in one process
    for r, p in zip(ref, parts):
        r.load_state_dict(p.state_dict())
    F.mse_loss(ref[1](*ref[0](x)), y).backward()
    stage = PipelineStage(parts[rank], rank, 2, "cpu")
    schedule = Schedule1F1B(stage, 4, loss_fn=F.mse_loss)
    schedule.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
    if rank == 0:
        assert [m.dtype for m in stage.outputs_meta] == [torch.float32, torch.int64]
    for p, r in zip(parts[rank].parameters(), ref[rank].parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)
