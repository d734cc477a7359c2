"""The training loop, callable in-process: `train(config) -> TrainResult` on every rank.

    JobConfig -> model args + ParallelDims (checked before any group is made) -> corpus and
    tokenizer -> meshes -> model (same seed and init on every rank: one process's weights)
    -> build_parts (split, TP, AC, compile, FSDP; the schedule when pp > 1) -> AdamW per part
    -> per step: this rank's slice of the global batch -> forward/backward (or schedule.step)
       -> clip by the global grad norm -> step -> loss and figures agreed by one all-reduce
    -> validation every N steps -> (checkpoint) -> summary

The process group must exist (`plait run` + `plait.comm.init_process_group()`, or a
plait.testing pool rank); `main` in `plait.train.cli` makes it.

Losses reported are the global batch's mean: each rank holding the loss (the last stage's
ranks) adds loss / (dp * cp * tp) into one world all-reduce, so the figure is what one process
computes on the same batch (a cp rank's loss is the mean over its half-chunks: equal counts).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from plait import comm
from plait.data.text import TokenWindows, build_corpus
from plait.models.llama import Transformer
from plait.tensor import DTensor
from plait.train import metrics as M
from plait.train.checkpointing import (
    Checkpointer,
    TrainState,
    agreed_latest,
    export_safetensors,
)
from plait.train.checkpointing import load as load_checkpoint
from plait.train.config import JobConfig
from plait.train.data import BatchStream, val_batches
from plait.train.grads import grad_norm_sq, reduce_partial_grads
from plait.train.layout import ParallelDims, build_meshes, check, model_args  # noqa: F401 (re-exported)
from plait.train.parallelize import PipelineParts, build_parts, lm_loss


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # per step run here, global mean
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> held-out loss
    start_step: int = 0  # > 0 when resumed from a checkpoint
    records: list[M.StepRecord] = field(default_factory=list)
    graph_breaks: int = 0
    summary: str = ""
    # per step run here, this rank's bytes sent by mesh axis (plait.plan's labels: the axes
    # of size > 1 a group spans, "+"-joined), counted at plait.comm's door by CommDebugMode
    bytes_sent_by_axis: list[dict[str, int]] = field(default_factory=list)


def _lr_lambda(config: JobConfig):
    t = config.training

    def factor(step: int) -> float:  # step: optimizer steps taken so far
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _losses_of(parts: PipelineParts, out: object) -> torch.Tensor:
    loss = out
    if isinstance(loss, list):
        loss = torch.stack([x.full_tensor() if isinstance(x, DTensor) else x for x in loss]).mean()
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss.detach().float()


def _forward_backward(parts: PipelineParts, batch: torch.Tensor, *, train: bool,
                      cp_mesh: object | None = None) -> torch.Tensor | None:
    """Run one (local) batch; returns its mean loss on a rank that computes it, else None.
    With `cp_mesh`, inside context_parallel on this rank's sequence chunks (plait.train.context)."""
    x, y = batch[:, :-1], batch[:, 1:]
    if cp_mesh is None:
        return _run_batch(parts, x, y, train=train)
    from plait.train.context import cp_batch

    with cp_batch(parts.modules, x, y, mesh=cp_mesh) as (x_local, y_local):
        return _run_batch(parts, x_local, y_local, train=train)


def _run_batch(parts: PipelineParts, x: torch.Tensor, y: torch.Tensor, *, train: bool) -> torch.Tensor | None:
    if parts.schedule is None:
        (module,) = parts.modules
        loss = lm_loss(module(x), y)
        if train:
            loss.backward()
        return _losses_of(parts, loss)
    losses: list[torch.Tensor] = []
    args = (x,) if parts.has_first else ()
    target = y if parts.has_last else None
    if train:
        parts.schedule.step(*args, target=target, losses=losses, return_outputs=False)
    else:
        parts.schedule.eval(*args, target=target, losses=losses)
    return _losses_of(parts, losses) if parts.has_last else None


def _global_mean(local: torch.Tensor | None, dims: ParallelDims) -> float:
    t = torch.zeros((), dtype=torch.float64, device=comm.group_device(comm.world_group())) if local is None else local.double() / (dims.dp * dims.cp * dims.tp)
    comm.all_reduce(t, group=comm.world_group())
    return float(t)


def train(config: JobConfig) -> TrainResult:
    """Train per `config` on the current process group; every rank calls it."""
    world, rank = comm.world_size(), comm.global_rank()
    args, dims = check(config, world)
    torch.manual_seed(config.job.seed)
    run_dir = Path(config.job.dir)
    d = config.data
    corpus = dict(path=d.path, glob=d.glob, max_bytes=d.max_bytes, tokenizer=d.tokenizer,
                  vocab_size=d.vocab_size, cache_dir=run_dir / "tokenizer")
    if d.tokenizer == "bpe" and world > 1:  # rank 0 trains the BPE once; the others read its cache
        if rank == 0:
            tokens, _ = build_corpus(**corpus)
        comm.barrier(group=comm.world_group())
        if rank != 0:
            tokens, _ = build_corpus(**corpus)
    else:
        tokens, _ = build_corpus(**corpus)
    t = config.training
    train_set = TokenWindows(tokens, seq_len=t.seq_len, split="train", val_fraction=d.val_fraction)
    val_set = TokenWindows(tokens, seq_len=t.seq_len, split="val", val_fraction=d.val_fraction)

    device = comm.group_device(comm.world_group())  # NCCL: this rank's GPU; Gloo: the CPU
    meshes = build_meshes(dims, device.type)
    dp_rank = meshes.dp.get_local_rank()
    model = Transformer(args)
    model.init_weights(seed=config.job.seed)  # on the host: the same values on any device
    model.to(device)
    graph_breaks_before = _graph_breaks()
    parts = build_parts(model, dims, meshes, loss_fn=lm_loss, ac_mode=config.activation_checkpoint.mode,
                        ac_every=config.activation_checkpoint.every, compile=config.compile.enabled,
                        compile_backend=config.compile.backend)
    del model
    params = [p for m in parts.modules for p in m.parameters()]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=t.lr, betas=(0.9, 0.95), eps=t.eps,
                                    weight_decay=t.weight_decay) for m in parts.modules]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, _lr_lambda(config)) for o in optimizers]
    stream = BatchStream(train_set, global_batch=t.batch_size, dp_rank=dp_rank, dp_size=dims.dp,
                         seed=config.job.seed)
    held_out = val_batches(val_set, global_batch=t.batch_size, count=config.metrics.val_batches,
                           dp_rank=dp_rank, dp_size=dims.dp) if config.metrics.val_batches else []

    result = TrainResult()
    ck = config.checkpoint
    folder = Path(ck.folder or run_dir / "checkpoints")
    state = TrainState(parts.modules, optimizers, schedulers, stream, config.to_dict())
    checkpointer = Checkpointer(folder, async_mode=ck.async_mode, keep_latest_k=ck.keep_latest_k,
                                is_rank0=rank == 0) if ck.enabled else None
    start, found = 0, None
    if checkpointer is not None and ck.resume:
        found = agreed_latest(folder, group=comm.world_group())
        if found is not None:
            start = load_checkpoint(state, found[1], config=config)
    if found is None and ck.initial_load_path:  # a new run from another's checkpoint
        start = load_checkpoint(state, Path(ck.initial_load_path), config=config, model_only=ck.initial_load_model_only)
    result.start_step = start
    device_type = meshes.world.device_type
    fpt = M.flops_per_token(args, t.seq_len)
    peak = M.peak_flops(config.metrics.peak_flops, device_type)
    jsonl = config.metrics.jsonl or str(run_dir / "metrics.jsonl")
    log = M.MetricsLogger(jsonl, is_rank0=rank == 0, progress_total=t.steps, initial=start,
                          progress=config.metrics.progress)
    if rank == 0:
        # start_step > 0: resumed; the log then repeats the steps after that checkpoint that the
        # interrupted run had logged (plait plot keeps each step's last record)
        log.write("config", world_size=world, start_step=start, layout=dims.describe(),
                  params=args.num_params(), flops_per_token=fpt, peak_flops=peak, config=config.to_dict())

    def validate() -> float:
        for m in parts.modules:
            m.eval()
        with torch.no_grad():
            vals = [_global_mean(_forward_backward(parts, b.to(device), train=False, cp_mesh=meshes.cp), dims)
                    for b in held_out]
        for m in parts.modules:
            m.train()
        return sum(vals) / len(vals)

    tokens_per_step = t.batch_size * t.seq_len
    wall0 = time.perf_counter()
    from plait.debug import CommDebugMode

    for step in range(start + 1, t.steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        counter = CommDebugMode(track_modules=False).__enter__()  # the step's traffic, what plait.plan predicts
        batch = next(stream).to(device, non_blocking=True)  # data is made on the host
        live = None
        # the second step: AdamW's state exists from the first step's end (the steady state's peak);
        # plait plan --compare leaves the counted step out of its timings, as it does the first.
        # The batch is drawn first: its slices are views of the whole corpus' storage
        if config.metrics.live_bytes and step == min(start + 2, t.steps):
            from plait.train.live_bytes import LiveBytes, state_tensors

            live = LiveBytes([*state_tensors(parts.modules, optimizers), batch]).__enter__()
        local_loss = _forward_backward(parts, batch, train=True, cp_mesh=meshes.cp)
        reduce_partial_grads(params)
        norm_sq = grad_norm_sq(params, world=world, pp=dims.pp)
        comm.all_reduce(norm_sq, group=comm.world_group())
        norm = float(norm_sq.sqrt())
        if t.max_norm > 0 and norm > t.max_norm:
            coef = t.max_norm / (norm + 1e-6)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        peak_live = None
        if live is not None:
            live.__exit__(None, None, None)
            peak_live = torch.tensor(float(live.peak), dtype=torch.float64, device=device)
            comm.all_reduce(peak_live, group=comm.world_group(), op="max")
            peak_live = int(peak_live)
        lr = schedulers[0].get_last_lr()[0]
        for s in schedulers:
            s.step()
        loss = _global_mean(local_loss, dims)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        mem = torch.tensor(float(M.peak_memory_bytes(device_type)), device=comm.group_device(comm.world_group()))
        comm.all_reduce(mem, group=comm.world_group(), op="max")
        counter.__exit__(None, None, None)
        # the job's CPU seconds this step, every rank's threads (Gloo's too): what time-sharing
        # ranks on fewer cores divide among them. Outside the counter: not the step's traffic
        cpu = torch.tensor(cpu, dtype=torch.float64, device=mem.device)
        comm.all_reduce(cpu, group=comm.world_group())
        result.bytes_sent_by_axis.append(M.bytes_by_axis(counter.events, dims))
        val = None
        every = config.metrics.val_every
        if held_out and ((every and step % every == 0) or step == t.steps):
            val = validate()
            result.val_losses[step] = val
        tps = tokens_per_step / dt
        record = M.StepRecord(step=step, loss=loss, lr=lr, grad_norm=norm, tokens_per_s=tps,
                              tokens_per_s_per_rank=tps / world, mfu=tps / world * fpt / peak,
                              step_time_s=dt, step_cpu_s=float(cpu), peak_memory_mib=float(mem) / 2**20, val_loss=val,
                              bytes_sent_by_axis=result.bytes_sent_by_axis[-1], peak_live_bytes=peak_live)
        result.losses.append(loss)
        log.log(record)
        if checkpointer is not None and ck.interval and step % ck.interval == 0 and step != t.steps:
            checkpointer.save(state, step)
    wall = time.perf_counter() - wall0
    if checkpointer is not None:
        if start < t.steps:
            checkpointer.save(state, t.steps, final=True)
        if ck.export_safetensors:  # every rank writes what it owns, from the live (saved) state
            export_safetensors(state, run_dir / "hf")
        comm.barrier(group=comm.world_group())
    result.records = log.records
    result.graph_breaks = _graph_breaks() - graph_breaks_before
    log.close()
    result.summary = M.summary(config, dims, args, result.records, result.val_losses, result.graph_breaks,
                               wall, device_type)
    if rank == 0:
        log_path = Path(jsonl)
        if log_path.exists():
            with open(log_path, "a") as f:
                import json

                f.write(json.dumps({"kind": "summary", "graph_breaks": result.graph_breaks,
                                    "wall_s": wall}) + "\n")
    return result


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())
