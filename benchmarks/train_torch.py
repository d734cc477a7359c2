"""The trainer's 2-D and 3-D layouts composed from torch's own strategies, as torchtitan composes them.

    plait train's config (the small one) -> the same Transformer, init seed, corpus, global
    batch stream (plait.train.data: one global stream dealt to the dp ranks), AdamW, LR schedule
    and clipping -> torch.distributed.device_mesh.init_device_mesh("cpu", (pp, dp_replicate, dp_shard, tp))
    -> per stage (pipeline split by the same layer counts):
       1. torch's parallelize_module with the Llama plan (Colwise/Rowwise/SequenceParallel,
          PrepareModuleInput, logits Shard(-1) for loss_parallel) — plait's plan, torch's classes
       2. torch's fully_shard(block, mesh=mesh["dp_shard"]) per block, then the stage module
          (HSDP, dp_replicate > 1: mesh["dp_replicate", "dp_shard"], the 2-D slice)
    -> torch.distributed.pipelining.PipelineStage + Schedule1F1B (the same microbatches)
    -> per step: forward/backward -> global grad norm (torchtitan's: DTensor norm, then a sum of
       squares over pp) -> clip -> step -> the global mean loss, reduced as plait's trainer does

Timed like plait's trainer: one step is from fetching the batch to the loss all-reduce and the
peak-memory all-reduce, so the two step times compare the same work. Not timed: building.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.data.text import TokenWindows, build_corpus
from plait.models.llama import Transformer
from plait.train import metrics as M
from plait.train.data import BatchStream
from plait.train.layout import resolve
from plait.train.parallelize import stage_module
from plait.train.trainer import _lr_lambda, model_args


def _torch_plan(*, loss_parallel: bool) -> dict:
    """plait.models.llama's tp_plan (sequence parallel) written with torch's styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    logits = dict(output_layouts=Shard(-1), use_local_output=False) if loss_parallel else \
        dict(output_layouts=Replicate(), use_local_output=True)
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), **logits),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                 desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.feed_forward.w3": ColwiseParallel(),
    }


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # vocab-sharded DTensor logits: the step runs inside torch's loss_parallel() (its backward
    # needs the context too, so torchtitan enters it around the whole forward-backward)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _plain(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def train_torch(config) -> dict:
    """Train `config` (dp_shard x tp x pp, or HSDP: dp_replicate x dp_shard with dp_shard > 1) with
    torch's strategies on this rank's
    pool; returns {"losses", "tps" (per step), "mem" (MiB, max over ranks)} on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    world = dist.get_world_size()
    args = model_args(config)
    t, d = config.training, config.data
    dims = resolve(config.parallel, t, args, world)
    assert (dims.dp_replicate == 1 or dims.dp_shard > 1) and dims.virtual_stages == 1 \
        and dims.pp_schedule == "1F1B", dims
    torch.manual_seed(config.job.seed)
    tokens, _ = build_corpus(path=d.path, glob=d.glob, max_bytes=d.max_bytes, tokenizer=d.tokenizer,
                             vocab_size=d.vocab_size, cache_dir=".")
    train_set = TokenWindows(tokens, seq_len=t.seq_len, split="train", val_fraction=d.val_fraction)
    mesh = init_device_mesh("cpu", (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    dp_rank = mesh.get_local_rank("dp_replicate") * dims.dp_shard + mesh.get_local_rank("dp_shard")
    fsdp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    stream = BatchStream(train_set, global_batch=t.batch_size, dp_rank=dp_rank,
                         dp_size=dims.dp, seed=config.job.seed)
    model = Transformer(args)
    model.init_weights(seed=config.job.seed)
    pp_rank = mesh.get_local_rank("pp")
    n = dims.pp
    module = model if n == 1 else stage_module(model, dims.stage_layers[pp_rank], first=pp_rank == 0,
                                               last=pp_rank == n - 1)
    if dims.tp > 1:
        plan = _torch_plan(loss_parallel=dims.loss_parallel)
        for top in ("tok_embeddings", "norm", "output"):
            if getattr(module, top) is None:
                plan.pop(top)
        parallelize_module(module, mesh["tp"], plan)
    if dims.dp_shard > 1:
        for block in module.layers.values():
            fully_shard(block, mesh=fsdp_mesh)
        fully_shard(module, mesh=fsdp_mesh)
    schedule = None
    if n > 1:
        stage = PipelineStage(module, pp_rank, n, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = Schedule1F1B(stage, dims.microbatches, loss_fn=_loss)
    first, last = pp_rank == 0, pp_rank == n - 1
    params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(0.9, 0.95), eps=t.eps, weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(config))
    loss_context = loss_parallel if dims.tp > 1 and dims.loss_parallel else contextlib.nullcontext
    losses, tps = [], []
    mem_max = 0.0
    for _ in range(t.steps):
        t0 = time.perf_counter()
        batch = next(stream)
        x, y = batch[:, :-1], batch[:, 1:]
        local = None
        with loss_context():
            if schedule is None:
                loss = _loss(module(x), y)
                loss.backward()
                local = _plain(loss).detach()
            else:
                out: list[torch.Tensor] = []
                schedule.step(*((x,) if first else ()), target=y if last else None, losses=out, return_outputs=False)
                if last:
                    local = torch.stack([_plain(v).detach() for v in out]).mean()
        # torchtitan's clip_grad_norm_ with pp: the stage's norm (a DTensor reduced to full), then
        # the squares summed over the pipeline axis
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if n > 1:
            sq = norm.double() ** 2
            dist.all_reduce(sq, group=mesh["pp"].get_group())
            norm = sq.sqrt()
        total = float(norm)
        if t.max_norm > 0 and total > t.max_norm:
            torch.nn.utils.clip_grads_with_norm_(params, t.max_norm, norm.float())
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        g = torch.zeros((), dtype=torch.float64) if local is None else local.double() / (dims.dp * dims.tp)
        dist.all_reduce(g)
        mem = torch.tensor(float(M.peak_memory_bytes("cpu")))
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        tps.append(t.batch_size * t.seq_len / (time.perf_counter() - t0))
        losses.append(float(g))
        mem_max = max(mem_max, float(mem) / 2**20)
    assert all(math.isfinite(v) for v in losses), losses
    return {"losses": losses, "tps": tps, "mem": mem_max}
