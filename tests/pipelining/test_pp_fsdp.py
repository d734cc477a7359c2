"""Pipeline x fully sharded data parallel on a 2-D mesh (pp, dp): stages that are `fully_shard`-ed.

4 ranks, mesh (pp=2, dp=2): global rank r runs pipeline rank r // 2 on data-parallel rank
r % 2. Each stage's blocks are fully_shard-ed on mesh["dp"] (one group each), then the stage
module (the root: embedding, norm, head where the stage has them). Each dp replica feeds its
half of the batch through its pipeline; after the step every parameter's sharded grad,
gathered, is the grad of the whole batch's mean loss, as one process computes it.

Checked every step: the dp-mean of the pipeline's loss and every gathered grad against the
reference; what each rank sends in the step (counted at plait.comm's door): exactly one
all-gather and one reduce-scatter per FSDP group of its stages, whatever the number of
microbatches (8), and nothing else; parameters after 3 AdamW steps, gathered. The split
backward (ZBV, DualPipeV: W writes .grad itself) is covered, and a float64 model whose
widths (3, 5, 24, 40, ...) do not all divide by the dp size, so shards are uneven.

Tolerances are test_runtime_parity's, for the same reason: the same math summed in another
order (per microbatch, then a reduce-scatter over 2 replicas instead of one mean).

bf16 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)): the reference is the
whole model fully_shard-ed alike without a pipeline, accumulating the same 8 microbatches
with set_requires_gradient_sync(False) until the last, so each microbatch rounds the same
way and the sums are in fp32 in the same order. Measured: identical (0 difference) for
1F1B and ZBV; allowed rtol 1e-5 / atol 1e-6. Adding the W grads of back-to-back zero-bubble
W steps in bf16 instead (FSDP's post-backward runs in I, before W) measured 4.5e-4.
"""

from __future__ import annotations

import copy

import pytest
import torch

from plait import comm
from plait.debug import CommDebugMode
from plait.device_mesh import init_device_mesh
from plait.fsdp import MixedPrecisionPolicy, fully_shard
from plait.pipelining import PipelineStage, build_schedule
from plait.pipelining.fully_sharded import ShardedGradSync
from plait.tensor import DTensor
from plait.testing import distributed
from tests.pipelining.test_runtime_parity import (
    LR,
    MICROBATCHES,
    SCHEDULES,
    STEPS,
    Block,
    _close,
    _data,
    _model,
    _reference,
    _stage_modules,
)

P2P = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


def _shard_stage(module: torch.nn.Module, mesh, mp_policy: MixedPrecisionPolicy) -> torch.nn.Module:
    for sub in list(module.modules())[1:]:
        if isinstance(sub, Block):
            fully_shard(sub, mesh=mesh, mp_policy=mp_policy)
    return fully_shard(module, mesh=mesh, mp_policy=mp_policy)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


_FSDP_REFERENCES: dict[tuple, tuple] = {}  # per worker process: both schedules compare against one


def _fsdp_reference(model, loss_fn, model_name: str, eps: float, dp_mesh, mp):
    """bf16: the whole model fully_shard-ed alike on the dp axis, no pipeline, accumulating
    the same microbatches (sync only on the last) and dividing by their count: the same
    bf16 rounding per microbatch, so only the fp32 summation order may differ.

    Computed once per worker process (it was 1.9 of the 3.0 CPU s a rank spends in one
    bf16 test) and reused by the other schedule's test: every rank of the pool runs both
    tests, so all of them skip its collectives together."""
    key = (model_name, eps, tuple(dp_mesh.mesh.tolist()), mp.param_dtype, mp.reduce_dtype)
    if key not in _FSDP_REFERENCES:
        _FSDP_REFERENCES[key] = _run_fsdp_reference(model, loss_fn, model_name, eps, dp_mesh, mp)
    return _FSDP_REFERENCES[key]


def _run_fsdp_reference(model, loss_fn, model_name: str, eps: float, dp_mesh, mp):
    model = _shard_stage(model, dp_mesh, mp)
    dp_rank = dp_mesh.get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=eps)
    losses, grads = [], []
    for step in range(STEPS):
        x, y = _data(model_name, step)
        half = x.shape[0] // 2
        x, y = x[dp_rank * half : (dp_rank + 1) * half], y[dp_rank * half : (dp_rank + 1) * half]
        opt.zero_grad()
        mb_losses = []
        for i, (xm, ym) in enumerate(zip(x.tensor_split(MICROBATCHES), y.tensor_split(MICROBATCHES))):
            model.set_requires_gradient_sync(i == MICROBATCHES - 1)
            loss = loss_fn(model(xm), ym)
            loss.backward()
            mb_losses.append(loss.detach())
        mean = torch.stack(mb_losses).mean()
        comm.all_reduce(mean, group=dp_mesh.get_group())
        losses.append(mean / 2)
        for p in model.parameters():
            p.grad.div_(MICROBATCHES)
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def check_pp_fsdp(schedule_name: str, model_name: str, bf16: bool = False) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    pp_rank, dp_rank = comm.get_rank(pp_group), comm.get_rank(dp_group)
    cls, v = SCHEDULES[schedule_name]
    model, loss_fn, tol = _model(model_name)
    mp = MixedPrecisionPolicy()
    if bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        tol = {**tol, "rtol": 1e-5, "atol": 1e-6, "params_atol": 1e-6}  # see the module note
        ref_losses, ref_grads, ref_params = _fsdp_reference(
            copy.deepcopy(model), loss_fn, model_name, tol["eps"], mesh["dp"], mp
        )
    else:
        ref_losses, ref_grads, ref_params = _reference(
            copy.deepcopy(model), loss_fn, model_name, tol["eps"]
        )
    num_stages = 2 * v
    plan = build_schedule(schedule_name, 2, MICROBATCHES, stages_per_rank=v if v > 1 else None)
    owned = list(plan.stages_of(pp_rank))
    modules = [_shard_stage(m, mesh["dp"], mp) for m in _stage_modules(model, model_name, num_stages, owned)]
    stages = [
        PipelineStage(m, s, num_stages, "cpu", group=pp_group) for m, s in zip(modules, owned)
    ]
    assert all(isinstance(s.grad_sync, ShardedGradSync) for s in stages)
    groups = sum(len(m._groups(recurse=True)) for m in modules)
    schedule = cls(stages[0] if v == 1 else stages, MICROBATCHES, loss_fn=loss_fn)
    params = {n: p for m in modules for n, p in m.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=LR, eps=tol["eps"])
    first, last = 0 in owned, num_stages - 1 in owned
    for step in range(STEPS):
        x, y = _data(model_name, step)
        half = x.shape[0] // 2
        x, y = x[dp_rank * half : (dp_rank + 1) * half], y[dp_rank * half : (dp_rank + 1) * half]
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        with CommDebugMode() as mode:
            schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        counts = mode.get_comm_counts()
        # per step: one all-gather and one reduce-scatter per group; besides them only p2p
        collectives = {k: n for k, n in counts.items() if k not in P2P}
        assert collectives == {"all_gather": groups, "reduce_scatter": groups}, dict(counts)
        for name, param in params.items():  # sharded between steps, grads too
            assert isinstance(param, DTensor) and isinstance(param.grad, DTensor), name
        if last:
            mean = torch.stack(losses).mean()
            comm.all_reduce(mean, group=dp_group)
            _close(mean / 2, ref_losses[step], tol, f"step {step} loss")
        for name, param in params.items():
            _close(_full(param.grad), ref_grads[step][name], tol, f"step {step} grad of {name}")
        opt.step()
    for name, param in params.items():
        torch.testing.assert_close(
            _full(param.detach()), ref_params[name], rtol=0, atol=tol["params_atol"], msg=name
        )


@distributed([4])
@pytest.mark.parametrize(
    "schedule_name, model_name",
    [
        ("1F1B", "transformer"),
        ("ZBVZeroBubble", "transformer"),  # split backward: I, then W writes .grad itself
        ("DualPipeV", "uneven"),  # float64, uneven shards, a tuple across a boundary
    ],
)
def test_pp_x_fsdp_matches_one_process(schedule_name, model_name):
    check_pp_fsdp(schedule_name, model_name)


@distributed([4])
@pytest.mark.parametrize("schedule_name", ["1F1B", "ZBVZeroBubble"])
def test_pp_x_fsdp_bf16_params_fp32_reduce(schedule_name):
    check_pp_fsdp(schedule_name, "transformer", bf16=True)


@distributed([2])
def test_a_group_initialised_under_an_outer_root_is_refused_before_any_step():
    """A block whose FSDP state a forward through the whole model made part of that root's
    tree cannot be a stage by itself (its post-backward would be the outer root's): a
    ValueError at PipelineStage(), naming the module, before anything is sent."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, loss_fn, _ = _model("transformer")
    _shard_stage(model, mesh, MixedPrecisionPolicy())
    x, _ = _data("transformer", 0)
    model(x[:2])  # the root initialises every state under it
    solo = comm.new_group([comm.get_rank(comm.world_group())])
    with pytest.raises(ValueError, match=r"fully_shard\(Block\) in this stage was initialised under a root outside"):
        PipelineStage(model.layers[0], 0, 1, "cpu", group=solo)
