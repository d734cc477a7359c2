"""Step time: compute at a FLOP rate, plus the host's cost per dispatched op, scaled by the
ranks sharing each core, plus communication per call and per byte and the pipeline's bubble
(torch-free).

    FLOPs per rank = tokens per rank * (6 * N_local + 12 * L * h/t * hd * s)   torchtitan's count:
        N_local the rank's TP-local block and output parameters (no embedding table), L its
        layers; activation checkpointing reruns forward: 8 instead of 6 on checkpointed blocks,
        or, calibrated, 6 * ac_factor (a checkpointed block's measured time over a plain one's)
    host ops, counted (constants below, each with the run it was counted on): per microbatch
        per block (plain, or TP's with its DTensor share; CP's ring ops per layer; x AC_OPS when
        checkpointed: 1.59, the forward again and the checkpoint's own) and per stage; per step per parameter (AdamW, grad norm, clip; on
        DTensors when FSDP or TP shards them; DDP's bucket copies) and per FSDP group
        (all-gather copy-out, reduce-scatter copy-in). Plain ops cost op_s, DTensor ops
        dtensor_op_s.
    collective calls and bytes per axis: traffic.calls_per_step / bytes_per_step (the same
        walk; the calls tested equal to plait.comm's count like the bytes)
    oversub      = max(1, ranks on this host / cores)  (hw.cores: os.sched_getaffinity at plan
                   time; 0, no oversubscription): ranks time-share the cores, so compute and
                   host time stretch by it; times the contention measured among the job's
                   process count (probe.py: their CPU seconds do less than one process's alone)
    microbatch   = oversub * (FLOPs / flop_rate + ops * op_s + dtensor ops * dtensor_op_s)
                 = tp_factor * oversub * (plain FLOPs / flop_rate + plain ops * op_s)   tp > 1,
                   calibrated at the job's process count: the probe's TP step among N ranks
                   (probe.py), its wall over the unsharded model's run the same way. It holds the TP
                   collectives (their CPU and waits: the tp axis is not charged again), the
                   DTensor dispatch and the work TP leaves unsharded, which op counts at one
                   per-op cost and FLOPs / t miss (measured: 2x the plain CPU per rank at tp 2).
                   R x T (dp_replicate * tp = N): the probe's step under replicate over N / tp,
                   which holds DDP's gradient take-in (per gradient on DTensors) and its
                   all-reduces: the dp_replicate axis and DDP's ops are not charged again.
                   FSDP x T (dp_replicate * dp_shard * tp = N, dp_shard > 1): the probe's step under
                   fully_shard over N / tp (per block, then the root, as plait train wraps), which
                   holds FSDP's copy-in and copy-out on DTensor parameters and its gathers and
                   reductions: the dp axes and FSDP's ops are not charged again (HSDP's shard
                   gathers, reductions and replica all-reduce move the same bytes per rank as
                   FSDP over their product at 2 x 2, in one more call per group).
                   FSDP and HSDP (dp_shard > 1, no TP, CP or PP): fsdp_factor(dp_shard) times
                   the plain model's, measured under fully_shard over groups of dp_shard: the
                   dp_shard axis and FSDP's ops are not charged again (HSDP's dp_replicate is)
    compute_s    = microbatch + the step's host ops                           pp = 1
                 = the pipeline simulator's makespan with F = microbatch / 3 per stage, B = 2F
                   (3F with AC), W = F, plus the step's host ops               pp > 1 (bubble in)
                 = max(makespan * (1 - bubble), makespan / oversub) + ...    pp > 1, oversub > 1:
                   ranks that share cores fill one another's bubbles (a rank's idle slot runs
                   another's work), unless the schedule's critical path at full speed is longer
    comm_s(ax)   = bytes(ax) / bandwidth(g) + calls(ax) * per_call(g)    g the axis' group size:
                   calibrated among the job's process count (calibrate.py: the wall a call adds
                   there, between compute bursts); otherwise latency * (g - 1) (Gloo's ring takes
                   g - 1 steps a call; latency measured at g = 2) and one bandwidth; on pp (the
                   stage-to-stage sends and receives), each call at the probe's p2p figure
                   where calibrated at the job's process count
    comm_s(pp)   = the simulator's makespan with each stage-to-stage transfer delayed by one
                   call's cost (comm_s(pp) as above over its calls) minus the makespan without:
                   the transfers the schedule leaves on its critical path (1F1B's steady state
                   waits on its neighbour each action; GPipe streams), not every call. Calibrated
                   at the job's process count and oversub > 1: every call, as above (a rank's wait
                   runs another's work; each call's figure is the wall it adds to a busy core)
    exposed      = calibrated at the job's process count and oversub > 1: all of comm_s (the
                   figures are the wall each call adds among ranks that fill every core: no core
                   is left to overlap it on); otherwise tp + pp + cp's ring (on the critical path:
                   the ring gathers K/V before its blocks compute) + max(0, dp - overlap *
                   compute_s) (FSDP/DDP gathers and reductions overlap compute, up to `overlap`)
    cp: a rank's tokens are B/dp * s/cp; each still attends over the whole sequence s;
                   calibrated, cp_factor times the plain model's, measured under fully_shard over
                   the cp group as plait train shards CP layouts: the cp axis (ring and FSDP's
                   collectives over it) and FSDP's ops are not charged again
    step_s       = compute_s + exposed

The figures (defaults, or calibrated) are hardware.py's Hardware.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from plait.plan.hardware import Hardware
from plait.plan.shapes import fsdp_groups, rank_coords, stage_params, stages_of
from plait.plan.traffic import calls_per_step, ring_bytes


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # FLOPs and host ops, oversubscription included
    host_s: float  # of which host ops
    comm_s: dict[str, float]
    exposed_s: float
    bubble: float
    step_s: float

    def dominant(self) -> str:
        """What the step spends most on: "compute", "bubble" or the axis of the most comm."""
        work = self.compute_s * (1 - self.bubble)
        parts = {"compute": work - self.host_s, "host": self.host_s, "bubble": self.compute_s * self.bubble}
        parts.update({f"comm:{k}": v for k, v in self.comm_s.items()})
        return max(parts, key=parts.get)


def stage_flops_per_token(args, dims, stage: int, *, seq_len: int, ac_mode: str, ac_every: int,
                          ac_factor: float = 0.0) -> float:
    d, hd, t = args.dim, args.head_dim, dims.tp
    f = args.ffn_hidden_dim()
    block = (2 * args.n_heads * hd * d + 2 * args.kv_heads * hd * d + 3 * d * f) / t
    attn = 12 * (args.n_heads / t) * hd * seq_len / 6  # per layer, in units of 6 * params
    total = 0.0
    for i in dims.stage_layers[stage]:
        checkpointed = ac_mode == "full" or (ac_mode == "every" and i % ac_every == 0)
        factor = (6 * ac_factor or 8) if checkpointed else 6  # measured: the whole block's time scales by it
        total += factor * (block + attn)
    if stage == dims.num_stages - 1:
        total += 6 * args.vocab_size * d / t
    return total


# Ops dispatched per step, counted with a TorchDispatchMode at the mode's level (a DTensor op counts
# once, its local ops not) on rank 0 of the small config (4 blocks, 39 parameters; 8 ranks but R1):
OPS_PER_BLOCK = 249  # a plain TransformerBlock, forward + backward (1034 a step with the stage's)
OPS_PER_STAGE = 30  # embedding, final norm, output, loss
OPS_PER_PARAM = 17  # R1: 648 a step beyond forward + backward: AdamW's 394, grad norm/clip/scalars 254
DTENSOR_OPS_PER_PARAM = 9  # of those, on DTensor parameters (S8: 351 of 39 parameters)
DDP_OPS_PER_PARAM = 2  # R8 - R1: 83 (each grad copied into its bucket and back)
FSDP_OPS_PER_GROUP = 170  # S8 - R1: 852 for 5 groups (all-gather copy-out, reduce-scatter copy-in, views)
CP_OPS_PER_LAYER = (292, 123)  # + per ring step (cp - 1): S4 C2 - S8, 1659 for 4 layers (cp 2), S2 C4 - S8,
# 2643 (cp 4): the ring's attention pieces and merges, one set per K/V chunk
TP_BLOCK = {True: (347, 155), False: (333, 99)}  # SP?: (ops, of them on DTensors) a block, R4 T2 / S4 T2 noSP
AC_OPS = 1 + 148 / 249  # a checkpointed block's ops over a plain one's: R8 AC:full - R8, 592 for 4 blocks
# (its forward again, 83, and the checkpoint's own: saved-tensor hooks, detaches, RNG state)


def cp_ops(cp: int) -> int:
    """Ring attention's own ops a layer, forward + backward, over `cp` ranks."""
    base, per_step = CP_OPS_PER_LAYER
    return base + per_step * (cp - 1) if cp > 1 else 0


def host_ops(args, dims, stage: int, *, ac_mode: str, ac_every: int, ac_factor: float = 0.0) -> tuple[float, float]:
    """(plain ops, DTensor ops) one microbatch's forward + backward dispatches on `stage` (ac_factor,
    when measured, scales a checkpointed block's ops as it does its time)."""
    plain = dt = 0.0
    sp = dims.sequence_parallel and dims.tp > 1
    for i in dims.stage_layers[stage]:
        factor = (ac_factor or AC_OPS) if ac_mode == "full" or (ac_mode == "every" and i % ac_every == 0) else 1.0
        if dims.tp > 1:
            ops, on_dtensors = TP_BLOCK[sp]
            dt += factor * on_dtensors
            plain += factor * (ops - on_dtensors)
        else:
            plain += factor * OPS_PER_BLOCK
        if dims.cp > 1:
            plain += factor * cp_ops(dims.cp)
    return plain + OPS_PER_STAGE, dt


def step_ops(args, dims, stages) -> tuple[float, float]:
    """(plain ops, DTensor ops) once a step: the optimizer, grad norm and clip per parameter, and
    the data-parallel wrappers' own (DDP per parameter, FSDP per group)."""
    params = [p for s in stages for p in stage_params(args, dims, s, 0)]
    sharded = dims.dp_shard * dims.cp > 1 or dims.tp > 1  # parameters are DTensors
    dt = DTENSOR_OPS_PER_PARAM * len(params) if sharded else 0
    plain = OPS_PER_PARAM * len(params) - dt
    return plain + _wrapper_ops(args, dims, stages), dt


def _wrapper_ops(args, dims, stages) -> float:
    """The data-parallel wrapper's own ops a step (step_ops' share: FSDP's per group, DDP's per
    parameter)."""
    params = [stage_params(args, dims, s, 0) for s in stages]
    if dims.dp_shard * dims.cp > 1:
        return FSDP_OPS_PER_GROUP * sum(len(fsdp_groups(p)) for p in params)
    return DDP_OPS_PER_PARAM * sum(len(p) for p in params) if dims.dp_replicate > 1 else 0.0


def oversubscription(dims, hw: Hardware) -> float:
    return max(1.0, dims.world_size / hw.cores) if hw.cores else 1.0


def _group_size(dims, label: str) -> int:
    sizes = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "tp": dims.tp, "pp": 2}
    g = 1
    for k in label.split("+"):
        g *= sizes.get(k, 1)
    return g


def step_time(args, dims, traffic: dict[str, int], hw: Hardware, *, seq_len: int, batch_size: int,
              global_rank: int, ac_mode: str = "none", ac_every: int = 2) -> StepTime:
    c = rank_coords(dims, global_rank)
    stages = stages_of(dims, c["pp"])
    tokens = batch_size // dims.dp * seq_len // dims.cp  # a cp rank's share; attention still spans seq_len
    kw = dict(seq_len=seq_len, ac_mode=ac_mode, ac_every=ac_every)
    over = oversubscription(dims, hw)
    if hw.in_situ(dims.world_size):  # what N ranks on these cores get done per CPU second, against one alone
        over *= hw.contention
    acf = dict(ac_factor=hw.ac_factor)
    m = dims.microbatches if dims.pp > 1 else 1
    once_plain, once_dt = step_ops(args, dims, stages)
    bubble = 0.0
    tp_f = hw.tp_factor(dims.tp, dims.sequence_parallel, dims.world_size) if dims.tp > 1 else 0.0
    # R x T, FSDP x T: the probe ran this layout's step itself (TP under replicate or fully_shard
    # over world / tp), the wrapper's take-in of DTensor gradients and its collectives included;
    # a cache from before that variant: the TP factor, and the wrapper charged as counted
    held_dp = []
    wrapper = "fully_shard" if dims.dp_shard > 1 else "replicate" if dims.dp_replicate > 1 else ""
    if dims.tp > 1 and wrapper and dims.dp_replicate * dims.dp_shard * dims.tp == dims.world_size:
        wrapped = hw.tp_factor(dims.tp, dims.sequence_parallel, dims.world_size, wrapper=wrapper)
        if wrapped:
            tp_f, held_dp = wrapped, ["dp_replicate", "dp_shard"]
            once_plain -= _wrapper_ops(args, dims, stages)
    cp_f = hw.cp_factor(dims.cp, dims.world_size) if dims.cp > 1 else 0.0
    fsdp_f = 0.0
    if dims.dp_shard > 1 and dims.tp == dims.cp == dims.pp == 1:  # FSDP, HSDP: the probe's FSDP step
        fsdp_f = hw.fsdp_factor(dims.dp_shard, dims.world_size)
    if cp_f or fsdp_f:  # the probe's step ran under fully_shard (over the cp group for CP): FSDP's own ops are in it
        once_plain -= _wrapper_ops(args, dims, stages)
    opt_host = over * (once_plain * hw.op_s + once_dt * hw.dtensor_op_s)
    measured = [f for f in (tp_f, cp_f, fsdp_f) if f]
    sharded = math.prod(measured) if measured else 0.0  # several: their product

    def microbatch(stage: int, n: float) -> tuple[float, float]:
        """(seconds, of them host) of one microbatch's forward + backward of `n` tokens on `stage`:
        FLOPs and the ops' host cost, stretched by the ranks sharing a core; with a measured TP
        or CP factor, the plain (unsharded) model's that way, times the factor."""
        if sharded:  # the plain model's time as the job's ranks would take it, times the factor
            plain = dataclasses.replace(dims, tp=1 if tp_f else dims.tp, cp=1 if cp_f else dims.cp)
            host = over * sum(host_ops(args, plain, stage, ac_mode=ac_mode, ac_every=ac_every, **acf)) * hw.op_s
            flops = n * stage_flops_per_token(args, plain, stage, **kw, **acf) / hw.flop_rate
            return sharded * (over * flops + host), sharded * host
        ops, dt = host_ops(args, dims, stage, ac_mode=ac_mode, ac_every=ac_every, **acf)
        host = over * (ops * hw.op_s + dt * hw.dtensor_op_s)
        return over * n * stage_flops_per_token(args, dims, stage, **kw, **acf) / hw.flop_rate + host, host

    crowded = hw.in_situ(dims.world_size) and over > 1  # ranks fill every core; figures measured among them
    calls = calls_per_step(args, dims, batch_size=batch_size, global_rank=global_rank, **kw)
    comm: dict[str, float] = {}
    for axis in sorted(set(traffic) | set(calls)):
        per_call, bandwidth = (hw.transfer(dims.world_size) if axis == "pp"
                               else hw.collective(_group_size(dims, axis), dims.world_size))
        comm[axis] = traffic.get(axis, 0) / bandwidth + calls.get(axis, 0) * per_call
    if dims.pp == 1:
        mb, mb_host = microbatch(0, tokens)
        host = mb_host + opt_host
        compute = mb + opt_host
    else:
        from plait.pipelining.schedules import Costs, build_schedule, simulate

        per_stage = [microbatch(s, tokens / m) for s in range(dims.num_stages)]
        fwd = sum(t for t, _ in per_stage) / len(per_stage) / 3
        backward = 3 * fwd if ac_mode != "none" else 2 * fwd
        plan = build_schedule(dims.pp_schedule, dims.pp, dims.microbatches,
                              stages_per_rank=dims.virtual_stages if dims.virtual_stages > 1 else None)
        costs = Costs(forward=fwd, backward=backward, weight=fwd)
        sim = simulate(plan, costs)
        # ranks that outnumber the cores fill one another's bubbles: a rank's idle slots go to the
        # others' work, so the step is the busy time (stretched), unless the schedule's own
        # critical path at full speed is longer
        busy = sim.makespan * (1 - sim.bubble)
        compute, bubble = max(busy, sim.makespan / over) + opt_host, sim.bubble
        host = sum(h for _, h in per_stage) / len(per_stage) * m * len(stages) + opt_host
        if calls.get("pp") and not crowded:
            # the stage-to-stage transfers cost what the schedule leaves on its critical path:
            # the simulator again, each transfer delayed by one call's cost (its share of the
            # axis' figure), against no delay. A schedule whose steady state waits on its
            # neighbour every action (1F1B) exposes more of them than one that streams (GPipe).
            # Not where ranks outnumber the cores and the figures were measured among them: there
            # a rank's wait runs another's work, as its bubble does, and each call's figure is
            # the wall it adds to a core that is never idle, so every call is charged
            delayed = simulate(plan, dataclasses.replace(costs, comm=comm["pp"] / calls["pp"]))
            comm["pp"] = delayed.makespan - sim.makespan
    held = [("tp", tp_f), ("cp", cp_f), ("dp_shard", fsdp_f)] + [(axis, tp_f) for axis in held_dp]
    for axis, f in held:  # the probe's step held the axis' collectives:
        if f:  # their CPU and their waits are in compute
            comm.pop(axis, None)
    if crowded:
        # measured where it is paid: each call's figure is the wall it adds among these ranks on
        # these cores (its own CPU, time-shared, and the waits for its group); no core is left to
        # overlap it with, so all of it is exposed
        exposed = sum(comm.values())
    else:
        # the ring's all-gather runs before its blocks compute: on the critical path, as tp and pp are
        ring = ring_bytes(args, dims, [i for s in stages for i in dims.stage_layers[s]], seq_len=seq_len,
                          batch_size=batch_size, ac_mode=ac_mode, ac_every=ac_every) / hw.bandwidth
        critical = sum(v for k, v in comm.items() if "tp" in k.split("+") or k == "pp") + ring
        dp = sum(v for k, v in comm.items() if not ("tp" in k.split("+") or k == "pp")) - ring
        exposed = critical + max(0.0, dp - hw.overlap * compute)
    return StepTime(compute, host, comm, exposed, bubble, compute + exposed)
