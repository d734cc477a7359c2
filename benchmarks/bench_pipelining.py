"""plait.pipelining vs torch.distributed.pipelining: step time; bubble vs the simulator.

Both run in the same processes (Gloo, one thread per rank), on copies of the same stage
modules, the same split and the same schedule, 8 microbatches, world sizes 2 and 4.

1. Step time: a small transformer (its stages are real compute). A sample is the slowest
   rank's time for one `step()`; plait and torch alternate, and the table shows medians.
   With 4 ranks on 2 cores the ranks share cores, so those ratios carry scheduling noise.
2. Bubble (pipelining_bubble.py): stages that sleep instead of computing (F = 1 unit; B = 2, split as I = 1 on
   the input path and W = 1 on the weight path), so two cores are no limit. Every sleep is
   logged; over one step, with T the window from the first sleep's start to the last's end
   on any rank, bubble = 1 - sum(sleep) / (p * T), the simulator's definition, compared
   with `simulate(schedule, Costs(1, 2, 1))`. The batch requires grad, so the first stage's
   backward splits into I and W like every other (plait splits it; torch always runs the
   first stage's whole backward at W, one reason its ZB bubbles differ). Each row also
   compares `simulate` with Costs.comm = the measured one-way p2p time, then with
   Costs.host = the time a rank is awake between two sleeps and not waiting: the stages'
   own autograd and tensor work (timed in a plain loop), and with it each runtime's CPU
   per compute action beyond the stages' own. Measured minus the simulator with the stages'
   own time is the runtime's share of the bubble; minus the one with both, what is left.
3. Per-action overhead: 4x4 linear stages, 1F1B (and ZBV) over 8 microbatches on 1 and 2
   ranks; the step's CPU time (thread_time, so other jobs on the machine count less) minus
   that of the same forwards and backwards in a plain loop, per compute action, in µs;
   plait with its default flight recorder on the door, and without any listener.
4. PP x DDP: 4 ranks as (pp=2, dp=2), 1F1B, every stage's module DDP on its dp group
   (plait.ddp with plait.pipelining, torch's DDP with torch's pipelining), each replica
   half the batch; slowest rank's step time.
5. PP x FSDP: the same mesh and split, every block of a stage fully_shard-ed on the dp axis
   and then the stage module (plait.fsdp with plait.pipelining, torch's fully_shard with
   torch's pipelining, default options); slowest rank's step time, and the all-gathers and
   reduce-scatters one rank issues per step (plait's counted with plait.debug.CommDebugMode,
   torch's with torch's CommDebugMode): plait gathers each group once per step, torch's
   1F1B once per forward and once per backward of every microbatch; both reduce-scatter
   once per group per step.
"""

from __future__ import annotations

import copy
import math
import time

import torch
import torch.distributed as dist
import torch.distributed.pipelining as tpp
import torch.nn.functional as F
from torch import nn

import plait.pipelining as pp
from benchmarks.common import median, print_table, ratio
from plait.pipelining import build_schedule
from plait.testing import run_distributed

MICROBATCHES = 8
SCHEDULES = {  # name -> (stages per rank, placement style)
    "GPipe": (1, "loop"),
    "1F1B": (1, "loop"),
    "Interleaved1F1B": (2, "loop"),
    "LoopedBFS": (2, "loop"),
    "InterleavedZeroBubble": (2, "loop"),
    "ZBVZeroBubble": (2, "v"),
    "DualPipeV": (2, "v"),  # needs m >= 2p: 8 microbatches on up to 4 ranks
}


# --- models -------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Module):
    """Units: embed, layers.0 .. layers.7, head (norm inside head)."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# --- one schedule on both implementations -------------------------------------------------


def _owned(name: str, p: int) -> list[int]:
    v, _ = SCHEDULES[name]
    return list(
        build_schedule(name, p, MICROBATCHES, stages_per_rank=v if v > 1 else None).stages_of(
            dist.get_rank()
        )
    )


def _schedules(name: str, modules: dict[int, nn.Module], num_stages: int, loss_fn, first: str = "plait"):
    """(plait schedule, torch schedule), each over its own copies of `modules`, the `first`
    library's built first (the heap's layout favours one side: bench_host builds both ways)."""
    group = dist.group.WORLD

    def build(lib: str) -> list:
        if lib == "plait":
            return [pp.PipelineStage(copy.deepcopy(m), s, num_stages, "cpu", group=group) for s, m in modules.items()]
        return [tpp.PipelineStage(copy.deepcopy(m), s, num_stages, torch.device("cpu"), group=group)
                for s, m in modules.items()]

    built = {lib: build(lib) for lib in (first, "torch" if first == "plait" else "plait")}
    ours, theirs = built["plait"], built["torch"]
    if SCHEDULES[name][0] == 1:
        return (
            getattr(pp, f"Schedule{name}")(ours[0], MICROBATCHES, loss_fn=loss_fn),
            getattr(tpp, f"Schedule{name}")(theirs[0], MICROBATCHES, loss_fn=loss_fn),
        )
    return (
        getattr(pp, f"Schedule{name}")(ours, MICROBATCHES, loss_fn=loss_fn),
        getattr(tpp, f"Schedule{name}")(theirs, MICROBATCHES, loss_fn=loss_fn),
    )


def _run_step(schedule, stages: list[int], num_stages: int, x, y) -> None:
    for p in _params(schedule):
        p.grad = None
    schedule.step(*((x,) if 0 in stages else ()), target=y if num_stages - 1 in stages else None)


def _params(schedule) -> list[torch.Tensor]:
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    return [p for s in stages for p in s.submod.parameters()]


def _step_times(names: list[str], reps: int) -> list[tuple]:
    torch.manual_seed(0)
    p = dist.get_world_size()
    rows = []
    for name in names:
        v, _ = SCHEDULES[name]
        num_stages = p * v
        model = Transformer()
        unit_names = pp.split_evenly(model, num_stages)
        owned = _owned(name, p)
        modules = dict(zip(owned, pp.split_model(model, unit_names, owned)))
        ours, theirs = _schedules(name, modules, num_stages, lm_loss)
        tokens = torch.randint(0, 256, (4 * MICROBATCHES, 32))
        y = torch.roll(tokens, -1, dims=1)
        t = {"plait": [], "torch": []}
        pair = [("plait", ours), ("torch", theirs)]
        for rep in range(reps + 1):
            for impl, schedule in pair if rep % 2 else pair[::-1]:  # neither always runs first
                dist.barrier()
                start = time.perf_counter()
                _run_step(schedule, owned, num_stages, tokens, y)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep:  # the first step infers shapes: not timed
                    t[impl].append(elapsed.item())
        rows.append((name, num_stages, median(t["plait"]), median(t["torch"])))
    return rows


def _action_overhead(
    name: str, reps: int, listeners: bool = True, m: int = MICROBATCHES
) -> tuple[float, float]:
    """(plait, torch) CPU µs per compute action beyond the compute itself, on this rank:
    `name` over the group's ranks (one 4x4 linear per stage; p2p between ranks), the step's
    thread_time minus that of the same forwards and backwards in a plain loop, per compute
    action of this rank. Blocked waits cost no CPU time, so the figure is the runtime's own
    work (planning, p2p posting, bookkeeping, microbatch split and merge), not the peers'.
    `listeners=False`: with plait.debug's flight recorder taken off plait.comm's door."""
    from plait.comm import events

    saved = events._debug
    if not listeners:
        events.set_debug_listener(None)
    try:
        return _overhead_of(name, reps, m)
    finally:
        events.set_debug_listener(saved)


def _overhead_of(name: str, reps: int, m: int) -> tuple[float, float]:
    torch.manual_seed(0)
    p, rank = dist.get_world_size(), dist.get_rank()
    v, _ = SCHEDULES[name]
    num_stages = p * v
    owned = _owned(name, p)
    modules = {s: nn.Linear(4, 4) for s in owned}
    x = torch.randn(2 * m, 4, requires_grad=True)
    y = torch.randn(2 * m, 4)
    plan = build_schedule(name, p, m, stages_per_rank=v if v > 1 else None)
    actions = sum(1 for a in plan.actions[rank] if a.is_compute)
    runs = {}
    for impl, schedule in zip(("plait", "torch"), _schedules(name, modules, num_stages, F.mse_loss)):
        runs[impl] = lambda schedule=schedule: _run_step(schedule, owned, num_stages, x, y)
    bare_modules = [copy.deepcopy(modules[s]) for s in owned]
    xm, ym, gm = torch.randn(2, 4, requires_grad=True), torch.randn(2, 4), torch.ones(2, 4)

    def bare() -> None:
        for module in bare_modules:
            for _ in range(m):
                out = module(xm)
                if module is bare_modules[-1] and num_stages - 1 in owned:
                    F.mse_loss(out, ym).backward()
                else:
                    out.backward(gm)

    runs["bare"] = bare
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(reps + 5):
        for key, fn in runs.items():
            if p > 1:
                dist.barrier()
            start = time.thread_time()
            fn()
            if rep >= 5:
                times[key].append(time.thread_time() - start)
    med = {k: median(v) for k, v in times.items()}
    return tuple((med[k] - med["bare"]) / actions * 1e6 for k in ("plait", "torch"))


def _pp_ddp_times(reps: int) -> tuple[float, float]:
    """(plait, torch) slowest-rank step time of 1F1B x DDP on (pp=2, dp=2)."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from plait.ddp import DistributedDataParallel
    from plait.device_mesh import init_device_mesh

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    torch_pp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    torch_dp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    pp_rank, dp_rank = rank // 2, rank % 2
    torch.manual_seed(0)
    model = Transformer()
    module = pp.split_model(model, pp.split_evenly(model, 2), pp_rank)[0]
    ours = pp.Schedule1F1B(
        pp.PipelineStage(
            DistributedDataParallel(module, process_group=mesh["dp"].get_group()),
            pp_rank, 2, "cpu", group=mesh["pp"].get_group(),
        ),
        MICROBATCHES,
        loss_fn=lm_loss,
    )
    theirs = tpp.Schedule1F1B(
        tpp.PipelineStage(
            TorchDDP(copy.deepcopy(module), process_group=torch_dp),
            pp_rank, 2, torch.device("cpu"), group=torch_pp,
        ),
        MICROBATCHES,
        loss_fn=lm_loss,
    )
    tokens = torch.randint(0, 256, (4 * MICROBATCHES, 32))[dp_rank::2]
    y = torch.roll(tokens, -1, dims=1)
    t = {"plait": [], "torch": []}
    for rep in range(reps + 1):
        for impl, schedule in (("plait", ours), ("torch", theirs)):
            dist.barrier()
            start = time.perf_counter()
            _run_step(schedule, [pp_rank], 2, tokens, y)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep:
                t[impl].append(elapsed.item())
    return median(t["plait"]), median(t["torch"])


def _pp_fsdp_times(reps: int) -> tuple[float, float, dict, dict]:
    """(plait, torch) slowest-rank step time of 1F1B x FSDP on (pp=2, dp=2), and each one's
    collectives per step on this rank."""
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from plait.debug import CommDebugMode
    from plait.device_mesh import init_device_mesh
    from plait.fsdp import fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    tmesh = torch_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = rank // 2, rank % 2
    torch.manual_seed(0)
    model = Transformer()
    module = pp.split_model(model, pp.split_evenly(model, 2), pp_rank)[0]
    copied = copy.deepcopy(module)
    for shard, m, dp in ((fully_shard, module, mesh["dp"]), (torch_fully_shard, copied, tmesh["dp"])):
        for sub in list(m.modules())[1:]:
            if isinstance(sub, Block):
                shard(sub, mesh=dp)
        shard(m, mesh=dp)
    ours = pp.Schedule1F1B(
        pp.PipelineStage(module, pp_rank, 2, "cpu", group=mesh["pp"].get_group()),
        MICROBATCHES,
        loss_fn=lm_loss,
    )
    theirs = tpp.Schedule1F1B(
        tpp.PipelineStage(copied, pp_rank, 2, torch.device("cpu"), group=tmesh["pp"].get_group()),
        MICROBATCHES,
        loss_fn=lm_loss,
    )
    tokens = torch.randint(0, 256, (4 * MICROBATCHES, 32))[dp_rank::2]
    y = torch.roll(tokens, -1, dims=1)
    t = {"plait": [], "torch": []}
    counts = {}
    for rep in range(reps + 1):
        for impl, schedule in (("plait", ours), ("torch", theirs)):
            dist.barrier()
            start = time.perf_counter()
            _run_step(schedule, [pp_rank], 2, tokens, y)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep:
                t[impl].append(elapsed.item())
    for impl, schedule, mode in (("plait", ours, CommDebugMode()), ("torch", theirs, _TorchCounts())):
        dist.barrier()
        with mode:  # one more step, counted (not timed)
            _run_step(schedule, [pp_rank], 2, tokens, y)
        counts[impl] = dict(mode.get_comm_counts())
    counts["plait"]["groups"] = len(module._groups(recurse=True))
    return median(t["plait"]), median(t["torch"]), counts["plait"], counts["torch"]


def run(quick: bool) -> None:
    from benchmarks import pipelining_bubble as bubble  # it imports this module's helpers

    names = list(SCHEDULES)
    reps = 3 if quick else 5
    # a step here is ~50-100 ms: 5 of them left a row's ratio to luck (InterleavedZeroBubble at
    # world 2 read 1.12 once, 0.87-0.95 in three runs of 15), so the step-time table takes more
    step_reps = 3 if quick else 15
    unit = 0.02 if quick else 0.04
    time_rows, bubble_rows = [], []
    for world in (2, 4):
        timed = run_distributed(_step_times, names, step_reps, world_size=world, timeout=1800)[0]
        for name, stages, ours, theirs in timed:
            time_rows.append(
                (
                    world,
                    name,
                    stages,
                    f"{ours * 1e3:.1f}",
                    f"{theirs * 1e3:.1f}",
                    ratio(ours, theirs),
                )
            )
        bubbles = run_distributed(bubble.rows, names, reps, unit, world_size=world, timeout=1800)[0]
        for (name, stages, sim, sim_latency, latency, ours, theirs, own_us, ours_us, theirs_us,
             sim_own, ours_host, theirs_host) in bubbles:
            bubble_rows.append(
                (
                    world,
                    name,
                    stages,
                    f"{sim:.1%}",
                    f"{sim_latency:.1%} ({latency * 1e3:.2f} ms)",
                    f"{ours:.1%}",
                    f"{(ours - sim_latency) * 100:+.1f}",
                    f"{own_us:.0f}",
                    f"{sim_own:.1%}",
                    f"{(ours - sim_own) * 100:+.1f}",
                    f"{ours_us:.0f}",
                    f"{(ours - ours_host) * 100:+.1f}",
                    f"{theirs:.1%}",
                    f"{(theirs - sim_own) * 100:+.1f}",
                    f"{theirs_us:.0f}",
                    f"{(theirs - theirs_host) * 100:+.1f}",
                )
            )
    overheads = [
        (label, run_distributed(_action_overhead, name, 100 if quick else 300, listeners,
                                world_size=world)) for label, name, world, listeners in (
            ("1 rank, 1F1B", "1F1B", 1, True),
            ("2 ranks, 1F1B", "1F1B", 2, True),
            ("2 ranks, 1F1B, no plait.comm listener", "1F1B", 2, False),
            ("2 ranks, ZBVZeroBubble", "ZBVZeroBubble", 2, True),
        )
    ]
    pp_ddp = run_distributed(_pp_ddp_times, reps, world_size=4, timeout=1800)[0]
    time_rows.append(
        (4, "1F1B x DDP (pp=2, dp=2)", 2, f"{pp_ddp[0] * 1e3:.1f}", f"{pp_ddp[1] * 1e3:.1f}",
         ratio(*pp_ddp))
    )
    fsdp_ours, fsdp_theirs, fsdp_counts, torch_counts = run_distributed(
        _pp_fsdp_times, reps, world_size=4, timeout=1800
    )[0]
    groups = fsdp_counts.pop("groups")
    time_rows.append(
        (4, "1F1B x FSDP (pp=2, dp=2)", 2, f"{fsdp_ours * 1e3:.1f}", f"{fsdp_theirs * 1e3:.1f}",
         ratio(fsdp_ours, fsdp_theirs))
    )
    ratios = [float(r[5]) for r in time_rows if r[5] != "n/a"]
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else float("nan")
    print_table(
        f"pipeline step time, plait vs torch.distributed.pipelining (Gloo, {MICROBATCHES} "
        f"microbatches, 8-layer transformer dim 64, median of {step_reps} steps, alternating which runs first)",
        ("world", "schedule", "stages", "plait ms", "torch ms", "plait/torch"),
        time_rows,
        notes=f"plait/torch over all rows (geometric mean): {geomean:.2f}. "
        "Same stage modules (copies), same split and schedule; the first step (shape "
        "inference) is not timed. 4 ranks share 2 cores. 1F1B x FSDP, collectives per step "
        f"on rank 0 ({groups} FSDP groups on its stage): plait {_collectives(fsdp_counts)}; torch "
        f"{_collectives(torch_counts)}.",
    )
    print_table(
        f"pipeline bubble with sleeping stages (F=1, I=1, W=1 unit of {unit * 1e3:.0f} ms; "
        f"{MICROBATCHES} microbatches; median of {reps} steps)",
        (
            "world",
            "schedule",
            "stages",
            "simulated",
            "sim with p2p latency",
            "plait",
            "plait - sim w/ latency (pts)",
            "stages' own µs/action",
            "sim w/ latency + own",
            "plait - that (pts)",
            "plait µs/action",
            "plait - sim w/ latency + own + plait µs (pts)",
            "torch",
            "torch - sim w/ latency + own (pts)",
            "torch µs/action",
            "torch - sim w/ latency + own + torch µs (pts)",
        ),
        bubble_rows,
        notes="simulated: plait.pipelining.simulate with Costs(F=1, B=2, W=1), transfers free; "
        "'with p2p latency': the same with Costs.comm = plait.comm's one-way p2p time measured "
        "in the same run (in brackets). Measured: 1 - sum of sleeps / (p * window), over all "
        "ranks' logged sleeps. Per compute action, mean over ranks: the stages' own µs is their "
        "wall time awake between sleeps (autograd and tensor work) in a plain loop; a "
        "runtime's µs is its CPU time (thread_time) beyond the stages' own forward and "
        "backward: its work between two sleeps (cold caches after each sleep make it larger "
        "than in the loop below). '+ own': the simulator with the stages' own µs as Costs.host "
        "(rank time before each compute that is not sleeping), so 'plait - that' is the "
        "runtime's share of the bubble; '+ own + plait µs': with the two summed, so what is "
        "left is what no per-action cost explains.",
    )
    print_table(
        f"pipeline runtime overhead per compute action (4x4 linear stages, {MICROBATCHES} "
        "microbatches, CPU µs beyond the compute, per rank)",
        ("setting", "plait µs", "torch µs", "plait/torch"),
        [
            (label, " / ".join(f"{r[0]:.1f}" for r in res), " / ".join(f"{r[1]:.1f}" for r in res),
             ratio(sum(r[0] for r in res), sum(r[1] for r in res)))
            for label, res in overheads
        ],
        notes="thread_time of a step minus the same forwards and backwards in a plain loop, "
        "per compute action of the rank (blocked waits cost no CPU). plait's default keeps "
        "plait.debug's flight recorder on plait.comm's door (one call site per p2p op); the "
        "'no plait.comm listener' row removes it.",
    )


def _collectives(counts: dict) -> str:
    """'all_gather 4, reduce_scatter 4' from a CommDebugMode count (p2p left out)."""
    keep = {k: n for k, n in counts.items() if "gather" in k or "reduce" in k}
    return ", ".join(f"{k} {n}" for k, n in sorted(keep.items())) or "none"


class _TorchCounts:
    """Counts torch.distributed's collectives called inside the block, by name.

    (torch's own CommDebugMode fails here: its module tracker loses its parent list under
    FSDP's hooks, `IndexError` in `_fw_set_module_hook`.) Each rank is a process, so
    patching the module's functions for the block counts this rank only."""

    NAMES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
             "reduce_scatter_tensor", "all_reduce")

    def __enter__(self):
        self.counts: dict[str, int] = {}
        self.saved = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        for name, fn in self.saved.items():
            def counted(*args, _fn=fn, _name=name, **kwargs):
                self.counts[_name] = self.counts.get(_name, 0) + 1
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def get_comm_counts(self) -> dict[str, int]:
        return self.counts
