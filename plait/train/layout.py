"""The parallel layout: resolve and check the dims before any process group exists, then build
the one named N-D mesh. Everything but `build_meshes` is torch-free (plait.plan calls it).

    Parallel section + world_size + ModelArgs --resolve()--> ParallelDims (every check here,
        pure: no process group, no tensor) --build_meshes()--> TrainMeshes
    world mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp"), every axis present (size 1 allowed)
      pp        the pipeline axis; stage s on pp rank given by the schedule
      dp        dp_replicate * dp_shard, flattened: the data-parallel ranks (each its own batch slice)
      cp        context parallel: the ranks of one batch slice, each holding 2 of 2*cp sequence
                chunks (plait.tensor.experimental.context_parallel; attention is a ring over it)
      fsdp      what fully_shard takes: mesh["dp_shard"] (FSDP) or mesh["dp_replicate",
                "dp_shard"] (HSDP), with cp > 1 the flattened ("dp_shard", "cp") axis
                "dp_shard_cp" in its place (cp ranks shard parameters too, as torchtitan does:
                their gradients are averaged with the data-parallel ones); over TP too (its
                parameters' placements are then torch's, (Replicate(), _StridedShard(0, sf=tp),
                Shard(0)) for colwise); None without dp_shard or cp
      replicate pure data parallel (dp_replicate > 1, dp_shard == 1): mesh["dp_replicate"], what
                plait.ddp.replicate takes (DDP semantics, as torchtitan runs pure DP); its
                parameters may be TP DTensors on mesh["tp"] (replicate reduces their local shards)
      tp        tensor (and sequence) parallel

Global rank order is row-major over (pp, dp_replicate, dp_shard, cp, tp): tp ranks are neighbours
(the fastest links), pp the outermost, as torchtitan lays them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from plait.models.llama.args import CONFIGS, ModelArgs
from plait.train.config import JobConfig, Parallel, Training

SINGLE_STAGE = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "Looped1F1B", "InterleavedZeroBubble", *V_SCHEDULES)


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    pp_schedule: str
    microbatches: int
    virtual_stages: int
    stage_layers: tuple[tuple[int, ...], ...]  # per pipeline stage, its layer indices
    sequence_parallel: bool
    loss_parallel: bool
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def describe(self) -> str:
        cp = f"cp({self.cp}) x " if self.cp > 1 else ""
        return (f"dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}) x {cp}tp({self.tp}) x "
                f"pp({self.pp}) = {self.world_size} ranks")


def model_args(config: JobConfig) -> ModelArgs:
    """The Llama config named by model.name, with the section's overrides, the tokenizer's
    vocabulary and room for training.seq_len."""
    m = config.model
    if m.name not in CONFIGS:
        raise ValueError(f"model.name {m.name!r} is not a plait.models.llama config: {sorted(CONFIGS)}")
    changes: dict[str, object] = {k: getattr(m, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")
                                  if getattr(m, k)}
    vocab = 256 if config.data.tokenizer == "byte" else config.data.vocab_size
    base = CONFIGS[m.name]
    return base.replace(**changes, vocab_size=vocab, tie_embeddings=m.tie_embeddings,
                        max_seq_len=max(base.max_seq_len, config.training.seq_len))


def check(config: JobConfig, world_size: int) -> tuple[ModelArgs, ParallelDims]:
    """Every check that needs no process group: the model, the layout, the schedule."""
    t = config.training
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(t, name) < 1:
            raise ValueError(f"training.{name} must be >= 1, got {getattr(t, name)}")
    args = model_args(config)
    return args, resolve(config.parallel, t, args, world_size)


def resolve(parallel: Parallel, training: Training, args: ModelArgs, world_size: int) -> ParallelDims:
    """Fill in -1 and 0 defaults and check that the layout fits the world, model and batch."""
    dims = {"dp_replicate": parallel.dp_replicate, "dp_shard": parallel.dp_shard,
            "cp": parallel.cp, "tp": parallel.tp, "pp": parallel.pp}
    bad = {k: v for k, v in dims.items() if v == 0 or v < -1}
    if bad:
        raise ValueError(f"parallel dims must be >= 1 or -1 (the rest): {bad}")
    rest = [k for k, v in dims.items() if v == -1]
    if len(rest) > 1:
        raise ValueError(f"only one parallel dim may be -1 (the rest), got {rest}")
    known = 1
    for v in dims.values():
        if v != -1:
            known *= v
    formula = " * ".join(f"{k}({v})" for k, v in dims.items() if v != 1 or k == "dp_shard")
    if rest:
        if world_size % known:
            raise ValueError(f"{formula.replace('(-1)', '(?)')}: the other dims multiply to {known}, "
                             f"which does not divide world_size({world_size})")
        dims[rest[0]] = world_size // known
    elif known != world_size:
        raise ValueError(f"{formula} = {known} != world_size({world_size})")
    dp_replicate, dp_shard, tp, pp = dims["dp_replicate"], dims["dp_shard"], dims["tp"], dims["pp"]
    cp = dims["cp"]
    if cp > 1 and training.seq_len % (2 * cp):
        raise ValueError(f"seq_len({training.seq_len}) is not divisible by 2 * cp({cp}) = {2 * cp}: context "
                         "parallel gives each cp rank 2 of 2*cp equal chunks (load-balanced causal attention)")
    if cp > 1 and tp > 1 and parallel.sequence_parallel and (training.seq_len // cp) % tp:
        raise ValueError(f"seq_len({training.seq_len}) / cp({cp}) = {training.seq_len // cp} is not divisible by "
                         f"tp({tp}) (sequence parallel shards each cp rank's sequence)")
    for what, heads in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads)):
        if heads % tp:
            raise ValueError(f"model {what}({heads}) is not divisible by tp({tp}): choose a tp that divides it")
    if args.vocab_size % tp:
        raise ValueError(f"vocab_size({args.vocab_size}) is not divisible by tp({tp})")
    if parallel.sequence_parallel and tp > 1 and training.seq_len % tp:
        raise ValueError(f"seq_len({training.seq_len}) is not divisible by tp({tp}) "
                         "(sequence parallel shards the sequence); or set parallel.sequence_parallel false")

    schedule, v = parallel.pp_schedule, parallel.virtual_stages
    is_csv = schedule.endswith(".csv")
    if pp > 1 and not is_csv:
        known_names = SINGLE_STAGE + MULTI_STAGE
        if schedule not in known_names:
            raise ValueError(f"unknown pp_schedule {schedule!r}; plait's schedules: {', '.join(known_names)}, "
                             "or a path to a CSV")
        if schedule in SINGLE_STAGE and v != 1:
            raise ValueError(f"pp_schedule {schedule} runs one stage per rank: virtual_stages({v}) must be 1")
        if schedule in MULTI_STAGE and v < 2:
            raise ValueError(f"pp_schedule {schedule} runs several stages per rank: set virtual_stages >= 2 "
                             f"(got {v})")
        if schedule in V_SCHEDULES and v != 2:
            raise ValueError(f"pp_schedule {schedule} places exactly 2 stages per rank: virtual_stages({v}) != 2")
    if is_csv and not Path(schedule).exists():
        raise ValueError(f"pp_schedule CSV {schedule!r} does not exist")
    if pp == 1:
        v = 1
    num_stages = pp * v
    stage_layers = _split_layers(args.n_layers, num_stages, parallel.pp_layers)

    dp = dp_replicate * dp_shard
    if training.batch_size % dp:
        raise ValueError(f"batch_size({training.batch_size}) is not divisible by the data-parallel degree "
                         f"dp_replicate({dp_replicate}) * dp_shard({dp_shard}) = {dp}")
    m = parallel.microbatches or (num_stages if pp > 1 else 1)
    local = training.batch_size // dp
    if pp > 1 and local % m:
        raise ValueError(f"the per-replica batch batch_size({training.batch_size}) / dp({dp}) = {local} "
                         f"is not divisible by microbatches({m})")
    if pp > 1 and schedule == "DualPipeV" and m < num_stages:
        raise ValueError(f"DualPipeV needs microbatches({m}) >= stages({num_stages})")
    if pp > 1 and not is_csv:
        from plait.pipelining import build_schedule  # pure: checks the schedule itself

        build_schedule(schedule, pp, m, stages_per_rank=v if v > 1 else None)
    return ParallelDims(world_size, dp_replicate, dp_shard, tp, pp, schedule, m, v, stage_layers,
                        parallel.sequence_parallel, parallel.loss_parallel, cp)


def _split_layers(n_layers: int, num_stages: int, explicit: list[int]) -> tuple[tuple[int, ...], ...]:
    if explicit:
        if len(explicit) != num_stages or sum(explicit) != n_layers or min(explicit) < 0:
            raise ValueError(f"pp_layers {explicit} must give {num_stages} stages (pp * virtual_stages) "
                             f"non-negative layer counts summing to n_layers({n_layers}); sum is {sum(explicit)}")
        counts = list(explicit)
    else:
        if n_layers % num_stages:
            raise ValueError(f"n_layers({n_layers}) is not divisible into {num_stages} pipeline stages "
                             f"(pp * virtual_stages); set parallel.pp_layers to split it by hand")
        counts = [n_layers // num_stages] * num_stages
    out, start = [], 0
    for c in counts:
        out.append(tuple(range(start, start + c)))
        start += c
    return tuple(out)


@dataclass
class TrainMeshes:
    world: object  # DeviceMesh ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    pp: object
    dp: object  # flattened dp_replicate x dp_shard
    tp: object
    fsdp: object | None  # None when dp_shard == cp == 1 and dp_replicate == 1, or when `replicate` is set
    replicate: object | None = None  # mesh["dp_replicate"] for pure data parallel (dp_shard == 1, cp == 1)
    cp: object | None = None  # mesh["cp"]: the 1-D mesh context_parallel takes


def build_meshes(dims: ParallelDims, device_type: str = "cpu") -> TrainMeshes:
    """The named 4-D mesh and the sub-meshes each strategy takes (see the module docstring)."""
    from plait.device_mesh import init_device_mesh

    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    world = init_device_mesh(device_type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
                             mesh_dim_names=names)
    dp = world["dp_replicate", "dp_shard"].flatten("dp")
    cp = world["cp"] if dims.cp > 1 else None
    fsdp = None
    if dims.dp_replicate > 1 and dims.dp_shard == 1 and dims.cp == 1:
        return TrainMeshes(world, world["pp"], dp, world["tp"], None, world["dp_replicate"])
    shard = "dp_shard"
    if dims.cp > 1:  # FSDP over every rank of a batch slice: dp_shard x cp, one axis
        shard = "dp_shard_cp"
        world["dp_shard", "cp"].flatten(shard)
    if dims.dp * dims.cp > 1:  # over TP too: fully_shard takes slices of the one root
        fsdp = world["dp_replicate", shard] if dims.dp_replicate > 1 else world[shard]
    return TrainMeshes(world, world["pp"], dp, world["tp"], fsdp, cp=cp)
