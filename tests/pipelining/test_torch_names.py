"""torch's pipelining names under plait: `schedules` as torch's module, `get_schedule_class`,
`build_stage(stage_module, i, pipe.info(), device, group)` and the in-forward `pipe_split()`.

Pure tests compare with torch's own functions where torch has them (get_schedule_class) and
with `SplitPoint.BEGINNING` for pipe_split (the same stages, the same forward bit for bit:
the stages call the model's modules eagerly, so rtol=atol=0). The distributed test trains a
pipe_split model through build_stage on 2 ranks against one process; see its docstring for
the tolerance.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait.pipelining as pipelining
from plait import comm
from plait.pipelining import (
    PipeInfo,
    Schedule1F1B,
    SplitPoint,
    build_stage,
    pipe_split,
    pipeline,
    schedule_classes,
    schedules,
)
from plait.pipelining import stage as stage_module
from plait.testing import distributed

TORCH_SCHEDULE_NAMES = [  # what torch's users import from torch.distributed.pipelining.schedules
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
    "PipelineScheduleSingle",
    "PipelineScheduleMulti",
    "get_schedule_class",
]


# --- plait.pipelining.schedules is torch's module too, and stays torch-free ---------------------


def test_importing_schedules_does_not_import_torch():
    """`plait plan pipeline` imports the schedules without torch; the classes load lazily
    (that they do load is the next test's, in this process)."""
    code = (
        "import sys\n"
        "import plait.pipelining.schedules as s\n"
        "import plait.pipelining\n"
        "s.build_schedule('Looped1F1B', 2, 4)\n"
        "assert 'ScheduleGPipe' in s.__all__ and 'get_schedule_class' in s.__all__\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", [*TORCH_SCHEDULE_NAMES, "ScheduleLooped1F1B"])
def test_schedules_exports_torchs_names_as_the_runtime_classes(name):
    got = getattr(schedules, name)
    assert got is getattr(schedule_classes, name)
    assert name in schedules.__all__
    if name.startswith("Schedule"):
        assert got is getattr(pipelining, name)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="ScheduleNope"):
        schedules.ScheduleNope  # noqa: B018


TORCH_KEYS = [  # torch's get_schedule_class keys (torch 2.x)
    "1F1B",
    "Interleaved1F1B",
    "GPipe",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "PipelineScheduleSingle",
    "PipelineScheduleMulti",
    "ZBVZeroBubble",
    "DualPipeV",
]


@pytest.mark.parametrize("key", TORCH_KEYS)
def test_get_schedule_class_matches_torchs(key):
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for spelling in (key, key.lower(), key.upper()):
        want = torch_schedules.get_schedule_class(spelling)
        got = schedules.get_schedule_class(spelling)
        assert got.__name__ == want.__name__
        assert got is getattr(schedules, want.__name__)


def test_get_schedule_class_knows_looped_1f1b_and_class_names():
    assert schedules.get_schedule_class("looped1f1b") is schedules.ScheduleLooped1F1B
    assert schedules.get_schedule_class("ScheduleGPipe") is schedules.ScheduleGPipe
    assert schedules.get_schedule_class("schedulezbvzerobubble") is schedules.ScheduleZBVZeroBubble


def test_get_schedule_class_names_the_valid_options():
    with pytest.raises(ValueError, match=r"Unknown schedule name 'Nope'.*'1F1B'.*'Looped1F1B'"):
        schedules.get_schedule_class("Nope")
    with pytest.raises(TypeError, match="must be a str"):
        schedules.get_schedule_class(None)


# --- pipe_split(): a cut inside forward ---------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, *, split_inside: bool = False) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.split_inside = split_inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.attn(x))
        if self.split_inside:
            pipe_split()
        return x + torch.tanh(self.mlp(x))


class Net(nn.Module):
    """embed -> 4 blocks -> head; `marks`: the blocks before which forward calls pipe_split()."""

    def __init__(self, marks=(), *, split_inside: int | None = None, dim: int = 6) -> None:
        super().__init__()
        self.marks = set(marks)
        self.embed = nn.Linear(3, dim)
        self.layers = nn.ModuleList(Block(dim, split_inside=i == split_inside) for i in range(4))
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pipe_split()  # before any work: no empty stage
        h = self.embed(x)
        for i, layer in enumerate(self.layers):
            if i in self.marks:
                pipe_split()
            h = layer(h)
        out = self.head(h)
        pipe_split()  # after all work: no empty stage either
        return out


def _chain(pipe, x):
    out = pipe.get_stage_module(0)(x)
    for s in range(1, pipe.num_stages):
        out = pipe.get_stage_module(s)(*(out if isinstance(out, tuple) else (out,)))
    return out


def _x() -> torch.Tensor:
    return torch.randn(2, 3, generator=torch.Generator().manual_seed(0))


def test_pipe_split_is_a_no_op_outside_tracing():
    torch.manual_seed(0)
    marked, plain = Net(marks=(1, 3), split_inside=2), Net()
    plain.load_state_dict(marked.state_dict())
    assert pipe_split() is None
    torch.testing.assert_close(marked(_x()), plain(_x()), rtol=0, atol=0)


@pytest.mark.parametrize("marks", [(2,), (1, 3), (1, 2, 3)])
def test_pipe_split_cuts_like_split_point_beginning(marks):
    torch.manual_seed(0)
    model = Net(marks=marks)
    by_marker = pipeline(model, (_x(),))
    plain = Net()
    plain.load_state_dict(model.state_dict())
    spec = {f"layers.{i}": SplitPoint.BEGINNING for i in marks}
    by_spec = pipeline(plain, (_x(),), split_spec=spec)
    assert by_marker.num_stages == len(marks) + 1
    assert by_marker.module_names_per_stage == by_spec.module_names_per_stage
    for s in range(by_marker.num_stages):  # the marker leaves no node behind
        graph = by_marker.get_stage_module(s).graph
        assert all(n.target is not pipe_split for n in graph.nodes)
    torch.testing.assert_close(_chain(by_marker, _x()), model(_x()), rtol=0, atol=0)


def test_pipe_split_inside_a_submodules_forward_cuts_there():
    torch.manual_seed(0)
    model = Net(split_inside=2)
    pipe = pipeline(model, (_x(),))
    assert pipe.module_names_per_stage == [
        ["embed", "layers.0", "layers.1", "layers.2.attn"],
        ["layers.2.mlp", "layers.3", "head"],
    ]
    torch.testing.assert_close(_chain(pipe, _x()), model(_x()), rtol=0, atol=0)


def test_pipe_split_and_split_spec_combine():
    torch.manual_seed(0)
    model = Net(marks=(1,), split_inside=2)
    pipe = pipeline(model, (_x(),), split_spec={"head": SplitPoint.BEGINNING})
    assert pipe.module_names_per_stage == [
        ["embed", "layers.0"],
        ["layers.1", "layers.2.attn"],
        ["layers.2.mlp", "layers.3"],
        ["head"],
    ]
    torch.testing.assert_close(_chain(pipe, _x()), model(_x()), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.export's own pytree deprecation
@pytest.mark.parametrize("marks, inside", [((2,), None), ((1, 3), 2)])
def test_pipe_split_stages_hold_the_parameters_torchs_do(monkeypatch, marks, inside):
    """The same model through torch's pipeline() with torch's pipe_split (torch.export, ~1 s)."""
    tp = pytest.importorskip("torch.distributed.pipelining")
    torch.manual_seed(0)
    model = Net(marks=marks, split_inside=inside)
    ours = pipeline(model, (_x(),))
    with monkeypatch.context() as m:  # Net's forwards call this module's `pipe_split`
        m.setattr(sys.modules[__name__], "pipe_split", tp.pipe_split)
        theirs = tp.pipeline(model, mb_args=(_x(),))
    assert ours.num_stages == theirs.num_stages
    # torch names its stages submod_pp_1.. here (its leading pipe_split); compare in order
    want = [sorted(n for n, _ in c.named_parameters()) for _, c in theirs.split_gm.named_children()]
    got = [
        sorted(n for n, _ in ours.get_stage_module(s).named_parameters())
        for s in range(ours.num_stages)
    ]
    assert got == want


# --- Pipe.info() and build_stage --------------------------------------------------------------


def test_pipe_info_describes_the_chain_of_stages():
    torch.manual_seed(0)
    model = Net(marks=(1, 3))
    pipe = pipeline(model, (_x(),))
    info = pipe.info()
    assert isinstance(info, PipeInfo) and info.num_stages == 3
    assert not info.has_loss_and_backward
    calls = [n.target for n in info.graph.nodes if n.op == "call_module"]
    assert calls == ["submod_0", "submod_1", "submod_2"]
    torch.testing.assert_close(pipe.split_gm(_x()), model(_x()), rtol=0, atol=0)


def test_build_stage_is_torchs_function_in_both_modules():
    assert build_stage is stage_module.build_stage is pipelining.build_stage
    assert pipelining.pipe_split is pipe_split


def test_build_stage_refuses_what_is_not_a_pipe_info_or_a_stage_of_it():
    pipe = pipeline(Net(marks=(2,)), (_x(),))
    with pytest.raises(TypeError, match="pipe_info must be a PipeInfo"):
        build_stage(pipe.get_stage_module(0), 0, 2, "cpu")
    with pytest.raises(ValueError, match=r"stage_index 2 is not in \[0, num_stages 2\)"):
        build_stage(pipe.get_stage_module(1), 2, pipe.info(), "cpu")


def _pipe_split_training(use_method: bool) -> None:
    """3 SGD steps, 4 microbatches, of Net(marks=(2,)) split by its pipe_split() on 2 ranks
    (rank r builds stage r), against the same model on one process on the whole batch.

    Tolerance: the pipeline sums 4 microbatch mean-losses' grads and divides by 4 where the
    reference takes one mean; only float32 rounding differs (seen: ~1e-7). Allowed: rtol
    1e-5, atol 1e-6; a lost or doubled microbatch moves grads by a quarter."""
    group = comm.world_group()
    rank = comm.get_rank(group)
    torch.manual_seed(0)
    model, reference = Net(marks=(2,)), Net()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]
    pipe = pipeline(model, (data[0][0][:2],))
    if use_method:
        stage = pipe.build_stage(rank, "cpu", group)
    else:
        stage = build_stage(pipe.get_stage_module(rank), rank, pipe.info(), "cpu", group)
    schedule = Schedule1F1B(stage, 4, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_params = dict(reference.named_parameters())
    for x, y in data:
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        losses: list[torch.Tensor] = []
        schedule.step(x, target=None, losses=losses) if rank == 0 else schedule.step(
            target=y, losses=losses
        )
        if rank == 1:
            torch.testing.assert_close(torch.stack(losses).mean(), ref_loss, rtol=1e-5, atol=1e-6)
        for name, p in stage.submod.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-6)
        opt.step()
        ref_opt.step()


@distributed([2])
@pytest.mark.parametrize("use_method", [False, True])
def test_build_stage_from_a_pipe_split_model_trains_like_one_process(use_method):
    _pipe_split_training(use_method)
