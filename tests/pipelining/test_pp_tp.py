"""Pipeline x tensor parallel on a 2-D mesh (pp, tp): stages whose parameters are DTensors.

4 ranks, mesh (pp=2, tp=2): global rank r runs pipeline rank r // 2 on tensor-parallel rank
r % 2. The Llama "tiny" config (8 heads, 4 KV heads: both split over tp 2) is cut into
stages by layers (the first keeps tok_embeddings, the last norm and output; the others are
set to None, which the model's forward allows), and each stage gets the canonical plan
with `parallelize_llama(stage, mesh["tp"])`. Both tp ranks of a pipeline rank see the same
batch; each tp pair is its own pipeline on `mesh["pp"]`.

What crosses a stage boundary is a plain tensor: under TP alone the residual stream
(b, s, dim), replicated (rowwise wo/w2 all-reduce, use_local_output); under TP+SP this tp
rank's sequence shard (b, s/tp, dim), sent to the same tp rank of the next stage, where
the first block's SequenceParallel norm takes it as its Shard(1) piece. Shapes are
inferred at the first step from those local tensors. The last stage's logits are either
gathered (loss_parallel=False: the loss_fn is a plain cross-entropy) or stay a DTensor
sharded on the vocabulary, the loss_fn computing under loss_parallel() and the schedule
merging the microbatches' DTensor outputs.

Checked every step: the loss (the mean of the microbatches' losses) and every parameter's
gathered grad against one process on the whole batch; parameters after 3 AdamW steps.
Tolerances are test_runtime_parity's float32 ones (rtol 1e-4 / atol 1e-5, AdamW eps 1e-3,
see there): the sharded contractions and per-microbatch means reorder the same sums.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from plait import comm
from plait.device_mesh import DeviceMesh, init_device_mesh
from plait.fsdp import fully_shard
from plait.models.llama import CONFIGS, Transformer, parallelize_llama
from plait.pipelining import PipelineStage, Schedule1F1B, build_schedule
from plait.pipelining.fully_sharded import ShardedGradSync
from plait.tensor import DTensor
from plait.tensor.parallel import loss_parallel
from plait.testing import distributed
from tests.pipelining.test_runtime_parity import SCHEDULES

MICROBATCHES = 4
BATCH = 8  # two sequences per microbatch
SEQ = 16  # splits over tp 2 under SP
STEPS = 3
LR = 1e-2
TOL = dict(rtol=1e-4, atol=1e-5)
EPS = 1e-3


def _model(num_stages: int) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(CONFIGS["tiny"].replace(n_layers=num_stages))  # one block per stage
    model.init_weights(seed=0)
    return model


def _stage(model: Transformer, s: int, num_stages: int) -> Transformer:
    """Stage s of `model` (a deep copy): block s only, embeddings first, norm and head last."""
    stage = copy.deepcopy(model)
    for name in list(stage.layers):
        if int(name) != s:
            del stage.layers[name]
    if s != 0:
        stage.tok_embeddings = None
    if s != num_stages - 1:
        stage.norm, stage.output = None, None
    return stage


def _tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(CONFIGS["tiny"].vocab_size, (BATCH, SEQ + 1), generator=g)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; inside loss_parallel() when the logits are vocab-sharded
    (its backward, run later by the stage, needs no context)."""
    if isinstance(logits, DTensor):
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _reference(model: Transformer):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, grads = [], []
    for step in range(STEPS):
        tok = _tokens(step)
        opt.zero_grad()
        loss = lm_loss(model(tok[:, :-1]), tok[:, 1:])
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _close(got, want, what):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def check_pp_tp(schedule_name: str, sequence_parallel: bool, vocab_parallel: bool = False) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp_group = mesh["pp"].get_group()
    pp_rank = comm.get_rank(pp_group)
    cls, v = SCHEDULES[schedule_name]
    num_stages = 2 * v
    model = _model(num_stages)
    ref_losses, ref_grads, ref_params = _reference(copy.deepcopy(model))
    plan = build_schedule(schedule_name, 2, MICROBATCHES, stages_per_rank=v if v > 1 else None)
    owned = list(plan.stages_of(pp_rank))
    modules = [
        parallelize_llama(
            _stage(model, s, num_stages), mesh["tp"],
            sequence_parallel=sequence_parallel, loss_parallel=vocab_parallel,
        )
        for s in owned
    ]
    stages = [
        PipelineStage(m, s, num_stages, "cpu", group=pp_group) for m, s in zip(modules, owned)
    ]
    assert all(s.grad_sync is None for s in stages)  # DTensor grads are complete: no sync
    schedule = cls(stages[0] if v == 1 else stages, MICROBATCHES, loss_fn=lm_loss)
    params = {n: p for m in modules for n, p in m.named_parameters()}
    assert all(isinstance(p, DTensor) for n, p in params.items() if "norm" not in n or sequence_parallel)
    opt = torch.optim.AdamW(params.values(), lr=LR, eps=EPS)
    first, last = 0 in owned, num_stages - 1 in owned
    mb_seq = SEQ // 2 if sequence_parallel else SEQ
    for stage in stages:  # learnt at the first step, below: local tensors, plain
        assert stage.inputs_meta is None
    for step in range(STEPS):
        tok = _tokens(step)
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        out = schedule.step(
            *((tok[:, :-1],) if first else ()), target=tok[:, 1:] if last else None, losses=losses
        )
        if last:
            assert out.shape == (BATCH, SEQ, CONFIGS["tiny"].vocab_size)
            assert isinstance(out, DTensor) == vocab_parallel, type(out)
            losses = [loss.full_tensor() if isinstance(loss, DTensor) else loss for loss in losses]
            _close(torch.stack(losses).mean(), ref_losses[step], f"step {step} loss")
        for name, param in params.items():
            grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
            _close(grad, ref_grads[step][name], f"step {step} grad of {name}")
        opt.step()
    for stage in stages:
        for meta in (stage.inputs_meta if not stage.is_first else ()):
            assert tuple(meta.shape) == (BATCH // MICROBATCHES, mb_seq, CONFIGS["tiny"].dim), meta
    for name, param in params.items():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        torch.testing.assert_close(full.detach(), ref_params[name], rtol=0, atol=TOL["atol"], msg=name)


@distributed([4])
@pytest.mark.parametrize(
    "schedule_name, sequence_parallel, vocab_parallel",
    [
        ("1F1B", False, False),
        ("1F1B", True, False),
        ("1F1B", True, True),  # logits stay sharded on the vocabulary: loss_parallel's loss
        ("ZBVZeroBubble", True, False),  # split backward: W on DTensor params writes .grad
        ("DualPipeV", False, True),
    ],
)
def test_pp_x_tp_matches_one_process(schedule_name, sequence_parallel, vocab_parallel):
    check_pp_tp(schedule_name, sequence_parallel, vocab_parallel)


@distributed([8])
def test_pp_x_fsdp_x_tp_matches_one_process():
    """3-D (pp=2, dp=2, tp=2), 1F1B: each stage parallelize_llama'd on tp (TP+SP), then its
    block and the stage fully_shard-ed on dp (FSDP over TP, on the pipeline rank's (dp, tp)
    slice as a 2-D mesh, which plait.fsdp requires); each dp replica half the batch.
    The dp-mean loss and every gathered grad each step, parameters after 3 steps."""
    world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp_group = world["pp"].get_group()
    pp_rank = comm.get_rank(pp_group)
    # fully_shard over TP takes a 2-D (dp, tp) root mesh: this pipeline rank's own slice
    mesh = DeviceMesh("cpu", world.mesh[pp_rank], mesh_dim_names=("dp", "tp"))
    dp_group = mesh["dp"].get_group()
    dp_rank = comm.get_rank(dp_group)
    model = _model(2)
    ref_losses, ref_grads, ref_params = _reference(copy.deepcopy(model))
    module = parallelize_llama(_stage(model, pp_rank, 2), mesh["tp"], loss_parallel=False)
    for block in module.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])
    stage = PipelineStage(module, pp_rank, 2, "cpu", group=pp_group)
    assert isinstance(stage.grad_sync, ShardedGradSync)
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=lm_loss)
    params = dict(module.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=LR, eps=EPS)
    half = BATCH // 2
    for step in range(STEPS):
        tok = _tokens(step)[dp_rank * half : (dp_rank + 1) * half]
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        schedule.step(
            *((tok[:, :-1],) if pp_rank == 0 else ()),
            target=tok[:, 1:] if pp_rank == 1 else None,
            losses=losses,
        )
        if pp_rank == 1:
            mean = torch.stack(losses).mean()
            comm.all_reduce(mean, group=dp_group)
            _close(mean / 2, ref_losses[step], f"step {step} loss")
        for name, param in params.items():
            _close(param.grad.full_tensor(), ref_grads[step][name], f"step {step} grad of {name}")
        opt.step()
    for name, param in params.items():
        torch.testing.assert_close(
            param.detach().full_tensor(), ref_params[name], rtol=0, atol=TOL["atol"], msg=name
        )
