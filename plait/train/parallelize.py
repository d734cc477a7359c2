"""Parallelize the Llama for training, in the one order that composes:

    full model (init on every rank, same seed: same weights as one process)
    -> pipeline split (pp > 1): stage s keeps its layers; tok_embeddings on stage 0, norm and
       output on the last (the others None, which Transformer.forward allows)
    -> per stage module:
       1. tensor parallel: parallelize_llama(module, mesh.tp) (+SP, logits vocab-sharded for
          loss_parallel when asked)
       2. activation checkpointing: none | full | every k-th block (by layer index)
       3. torch.compile per block (Module.compile: in place, FQNs unchanged)
       4. data parallel: FSDP / HSDP (dp_shard > 1): fully_shard(block) for each block, then
          fully_shard(stage module); pure DP (dp_replicate > 1, dp_shard == 1):
          replicate(stage module, device_mesh=mesh["dp_replicate"]) (DDP: whole grads bucketed
          and all-reduced, no gathers), which a pipeline stage reduces once per step
    -> PipelineStage(module, s, num_stages, group=mesh.pp.get_group()) and the schedule

FQNs stay torchtitan's through all of it (`layers.{i}.attention.wq`, ...): the checkpoint
of any layout has the same keys, which is what resuming on another layout needs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

from plait.models.llama import Transformer, parallelize_llama
from plait.tensor import DTensor
from plait.train.layout import ParallelDims, TrainMeshes


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (b, s, vocab) vs (b, s); under loss_parallel() when the logits
    are vocab-sharded DTensors (its backward needs no context)."""
    if isinstance(logits, DTensor):
        from plait.tensor.parallel import loss_parallel

        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def stage_module(model: Transformer, layers: tuple[int, ...], *, first: bool, last: bool) -> Transformer:
    """A deep copy of `model` holding only `layers` (and the ends it owns)."""
    stage = copy.deepcopy(model)
    for name in list(stage.layers):
        if int(name) not in layers:
            del stage.layers[name]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm, stage.output = None, None
    return stage


def apply_activation_checkpointing(module: Transformer, *, mode: str, every: int) -> int:
    """Recompute blocks' activations in backward: mode "full" (every block) or "every" (blocks
    whose layer index is a multiple of `every`); returns the number of blocks wrapped.

    Each chosen block becomes plait.activation_checkpointing.checkpoint_wrapper(block) in place;
    its state dict and named_parameters() drop the wrapper's prefix, so FQNs (and checkpoints)
    do not change. fully_shard then wraps the wrapper, so its gather runs before the recompute."""
    if mode == "none":
        return 0
    if mode not in ("full", "every"):
        raise ValueError(f"activation_checkpoint.mode must be none, full or every, got {mode!r}")
    if mode == "every" and every < 1:
        raise ValueError(f"activation_checkpoint.every must be >= 1, got {every}")
    from plait.activation_checkpointing.wrapper import checkpoint_wrapper

    wrapped = 0
    for name in list(module.layers):
        if mode == "full" or int(name) % every == 0:
            module.layers[name] = checkpoint_wrapper(module.layers[name])
            wrapped += 1
    return wrapped


def shard_stage(module: Transformer, mesh) -> None:
    """fully_shard each block, then the stage module (the root's group: embedding, norm, output)."""
    from plait.fsdp import fully_shard

    for block in module.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)


def parallelize_stage(module: Transformer, dims: ParallelDims, meshes: TrainMeshes, *,
                      ac_mode: str = "none", ac_every: int = 1, compile: bool = False,
                      compile_backend: str = "inductor") -> Transformer:
    """TP -> activation checkpointing -> compile -> FSDP or DDP on one stage (or the whole model)."""
    if dims.tp > 1:
        parallelize_llama(module, meshes.tp, sequence_parallel=dims.sequence_parallel,
                          loss_parallel=dims.loss_parallel)
    apply_activation_checkpointing(module, mode=ac_mode, every=ac_every)
    if compile:
        for block in module.layers.values():
            block.compile(backend=compile_backend)
    if meshes.fsdp is not None:
        shard_stage(module, meshes.fsdp)
    elif meshes.replicate is not None:
        from plait.ddp import replicate

        replicate(module, device_mesh=meshes.replicate)
    return module


class PipelineParts:
    """What one rank trains: its stage modules and, with pp > 1, the schedule that runs them."""

    def __init__(self, modules: list[Transformer], schedule: object | None, stage_ids: list[int],
                 num_stages: int) -> None:
        self.modules, self.schedule, self.stage_ids, self.num_stages = modules, schedule, stage_ids, num_stages

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids


def build_parts(model: Transformer, dims: ParallelDims, meshes: TrainMeshes, *, loss_fn: Callable,
                ac_mode: str, ac_every: int, compile: bool, compile_backend: str = "inductor") -> PipelineParts:
    """Split (pp > 1), parallelize each part, wrap the stages in the chosen schedule."""
    kw = dict(ac_mode=ac_mode, ac_every=ac_every, compile=compile, compile_backend=compile_backend)
    if dims.pp == 1:
        return PipelineParts([parallelize_stage(model, dims, meshes, **kw)], None, [0], 1)
    from plait import pipelining

    pp_rank = meshes.world.get_local_rank("pp")
    n, m = dims.num_stages, dims.microbatches
    csv = dims.pp_schedule.endswith(".csv")
    if csv:
        plan = pipelining.load_csv(dims.pp_schedule, num_microbatches=m)
    else:
        plan = pipelining.build_schedule(dims.pp_schedule, dims.pp, m,
                                         stages_per_rank=dims.virtual_stages if dims.virtual_stages > 1 else None)
    owned = sorted(plan.stages_of(pp_rank))
    modules = [parallelize_stage(stage_module(model, dims.stage_layers[s], first=s == 0, last=s == n - 1),
                                 dims, meshes, **kw) for s in owned]
    group = meshes.pp.get_group()
    device = meshes.world.device_type
    stages = [pipelining.PipelineStage(mod, s, n, device, group=group) for mod, s in zip(modules, owned)]
    if csv:
        schedule = pipelining.PipelineScheduleRuntime(stages, m, loss_fn=loss_fn)
        schedule.load_csv(dims.pp_schedule)
    else:
        cls = getattr(pipelining, f"Schedule{dims.pp_schedule}")
        schedule = cls(stages[0] if dims.virtual_stages == 1 else stages, m, loss_fn=loss_fn)
    return PipelineParts(modules, schedule, owned, n)
