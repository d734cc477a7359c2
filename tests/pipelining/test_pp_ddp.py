"""Pipeline x data parallel on a 2-D mesh (pp, dp): stages whose submodule is DDP or replicate.

4 ranks, mesh (pp=2, dp=2): global rank r runs pipeline rank r // 2 on data-parallel rank
r % 2. Each dp replica feeds its half of the batch through its pipeline (on the sub-mesh
`mesh["pp"]`); after the step every replica of a stage holds the grads of the whole batch's
mean loss, as one process computing on the whole batch does (the reference).

Checked every step: the dp-mean of the pipeline's loss and every owned grad against the
reference, and that each stage reduces its grads with exactly one all-reduce per step (not
one per microbatch: DDP's own per-backward sync stays off); parameters after 3 AdamW steps.
Tolerances are test_runtime_parity's, for the same reason (same math, other order of
summation: per microbatch, then over 2 replicas).
"""

from __future__ import annotations

import copy

import pytest
import torch

from plait import comm
from plait.ddp import DistributedDataParallel, replicate
from plait.debug import CommDebugMode
from plait.device_mesh import init_device_mesh
from plait.pipelining import PipelineStage, build_schedule
from plait.testing import distributed
from tests.pipelining.test_runtime_parity import (
    LR,
    MICROBATCHES,
    SCHEDULES,
    STEPS,
    _close,
    _data,
    _model,
    _reference,
    _stage_modules,
)


def check_pp_ddp(schedule_name: str, model_name: str, wrap: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    pp_rank, dp_rank = comm.get_rank(pp_group), comm.get_rank(dp_group)
    cls, v = SCHEDULES[schedule_name]
    model, loss_fn, tol = _model(model_name)
    ref_losses, ref_grads, ref_params = _reference(
        copy.deepcopy(model), loss_fn, model_name, tol["eps"]
    )
    num_stages = 2 * v
    plan = build_schedule(schedule_name, 2, MICROBATCHES, stages_per_rank=v if v > 1 else None)
    owned = list(plan.stages_of(pp_rank))
    modules = _stage_modules(model, model_name, num_stages, owned)
    if wrap == "DDP":
        submods = [DistributedDataParallel(m, process_group=dp_group) for m in modules]
    else:
        submods = [replicate(m, device_mesh=mesh["dp"]) for m in modules]
    stages = [
        PipelineStage(m, s, num_stages, "cpu", group=pp_group) for m, s in zip(submods, owned)
    ]
    assert all(s.grad_sync is not None for s in stages)
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
        # one gradient all-reduce per owned stage per step, nothing per microbatch
        assert mode.get_comm_counts()["all_reduce"] == len(owned), mode.get_comm_counts()
        if last:
            mean = torch.stack(losses).mean()
            comm.all_reduce(mean, group=dp_group)
            _close(mean / 2, ref_losses[step], tol, f"step {step} loss")
        for name, param in params.items():
            _close(param.grad, ref_grads[step][name], tol, f"step {step} grad of {name}")
        opt.step()
    for name, param in params.items():
        torch.testing.assert_close(
            param.detach(), ref_params[name], rtol=0, atol=tol["params_atol"], msg=name
        )


@distributed([4])
@pytest.mark.parametrize(
    "schedule_name, model_name, wrap",
    [
        ("1F1B", "transformer", "DDP"),
        # split backward: W writes .grad itself. (replicate adds a `join` method, which
        # would shadow the uneven model's child named `join`: DDP's wrapper there.)
        ("ZBVZeroBubble", "uneven", "DDP"),
        ("ZBVZeroBubble", "transformer", "replicate"),
        ("DualPipeV", "transformer", "replicate"),
    ],
)
def test_pp_x_ddp_matches_one_process(schedule_name, model_name, wrap):
    check_pp_ddp(schedule_name, model_name, wrap)
