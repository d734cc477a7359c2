"""Step time: compute at a FLOP rate, plus the host's cost per dispatched op, scaled by the
ranks sharing each core, plus exposed communication and the pipeline's bubble (torch-free).

    FLOPs per rank = tokens per rank * (6 * N_local + 12 * L * h/t * hd * s)   torchtitan's count:
        N_local the rank's TP-local block and output parameters (no embedding table), L its
        layers; activation checkpointing reruns forward: 8 instead of 6 on checkpointed blocks
    host ops (counted from the model's structure, fwd + bwd, per microbatch):
        OPS_PER_BLOCK per block (249: aten ops a TransformerBlock dispatches, counted with a
        TorchDispatchMode; x 8/6 when checkpointed), OPS_PER_STAGE per stage (embedding, final
        norm, output, loss), and per step OPS_PER_PARAM per local parameter (AdamW's 13 and the
        norm/clip's 3); DTensor ops, each costing dtensor_op_s instead of op_s: the optimizer's
        and clip's ops when parameters are DTensors (FSDP or TP), and DTENSOR_OPS_PER_BLOCK of
        a block's ops under TP (its 7 linears forward and backward, SP's redistributes)
    collective calls per axis: _ops (FSDP: all-gather + reduce-scatter per group and step ...)
    oversub      = max(1, ranks on this host / cores)  (hw.cores: os.sched_getaffinity at plan
                   time; 0, no oversubscription): ranks time-share the cores, so compute and
                   host time stretch by it
    compute_s    = oversub * (FLOPs / flop_rate + ops * op_s + dtensor ops * dtensor_op_s)  pp = 1
                 = the pipeline simulator's makespan with F = oversub * (forward FLOPs / rate +
                   its host ops) per microbatch per stage, B = 2F (3F with AC), W = F, plus the
                   optimizer's host time                                     pp > 1 (bubble in)
    comm_s(ax)   = bytes(ax) / bandwidth + calls(ax) * latency * (g - 1)    g the axis' group
                   size: Gloo's ring takes g - 1 steps a call; latency measured at g = 2
    exposed      = tp + pp + cp's ring (on the critical path: the ring gathers K/V before its
                   blocks compute) + max(0, dp - overlap * compute_s)
    cp: a rank's tokens are B/dp * s/cp; each still attends over the whole sequence s
                   (FSDP/DDP gathers and reductions overlap compute, up to `overlap` of it)
    step_s       = compute_s + exposed

Defaults (no --calibrate): 5e10 FLOP/s per rank, 8 us per op, 70 us per DTensor op (plait's
Python dispatch; measured on this 2-core host, loaded), Gloo 1e9 B/s and 50 us per call,
overlap 0.5. `--calibrate` measures the FLOP rate (one block's forward + backward at the
rank's shape, less its counted ops' host time), op_s (the same block at 8 tokens, where host
time dominates), dtensor_op_s, and Gloo's latency and bandwidth on 2 processes (calibrate.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from plait.plan.shapes import rank_coords, stage_params, stages_of
from plait.plan.traffic import ring_bytes


@dataclass(frozen=True)
class Hardware:
    flop_rate: float = 5e10  # FLOP/s per rank
    bandwidth: float = 1e9  # bytes/s a rank sends on a collective
    latency: float = 50e-6  # seconds per collective call on 2 ranks
    overlap: float = 0.5  # fraction of compute that can hide data-parallel communication
    op_s: float = 8e-6  # host seconds per dispatched aten op
    dtensor_op_s: float = 70e-6  # host seconds per op on a DTensor
    cores: int = 0  # cores the ranks share (0: one each, no oversubscription)
    source: str = "defaults"

    def as_dict(self) -> dict:
        return asdict(self)


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


def stage_flops_per_token(args, dims, stage: int, *, seq_len: int, ac_mode: str, ac_every: int) -> float:
    d, hd, t = args.dim, args.head_dim, dims.tp
    f = args.ffn_hidden_dim()
    block = (2 * args.n_heads * hd * d + 2 * args.kv_heads * hd * d + 3 * d * f) / t
    attn = 12 * (args.n_heads / t) * hd * seq_len / 6  # per layer, in units of 6 * params
    total = 0.0
    for i in dims.stage_layers[stage]:
        factor = 8 if ac_mode == "full" or (ac_mode == "every" and i % ac_every == 0) else 6
        total += factor * (block + attn)
    if stage == dims.num_stages - 1:
        total += 6 * args.vocab_size * d / t
    return total


OPS_PER_BLOCK = 249
OPS_PER_STAGE = 30
OPS_PER_PARAM = 16
DTENSOR_OPS_PER_BLOCK = 30


def host_ops(args, dims, stage: int, *, ac_mode: str, ac_every: int) -> tuple[float, float]:
    """(plain ops, DTensor ops) one microbatch's forward + backward dispatches on `stage`."""
    plain = dt = 0.0
    for i in dims.stage_layers[stage]:
        factor = 8 / 6 if ac_mode == "full" or (ac_mode == "every" and i % ac_every == 0) else 1.0
        if dims.tp > 1:
            dt += factor * DTENSOR_OPS_PER_BLOCK
            plain += factor * (OPS_PER_BLOCK - DTENSOR_OPS_PER_BLOCK)
        else:
            plain += factor * OPS_PER_BLOCK
    return plain + OPS_PER_STAGE, dt


def host_cores() -> int:
    """Cores this process may run on (the ranks of a one-host job share them)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def oversubscription(dims, hw: Hardware) -> float:
    return max(1.0, dims.world_size / hw.cores) if hw.cores else 1.0


def _ops(dims, args, stages: list[int]) -> dict[str, int]:
    """Collectives per step per axis, for the latency term (an estimate: traffic.py's list)."""
    layers = sum(len(dims.stage_layers[s]) for s in stages)
    m = dims.microbatches if dims.pp > 1 else 1
    out = {}
    if dims.tp > 1:
        out["tp"] = m * (8 * layers + 4)
    if dims.dp_shard * dims.cp > 1:  # FSDP over dp_shard, or the flattened (dp_shard, cp)
        out["dp_shard" if dims.dp_shard > 1 else "cp"] = 3 * (layers + 1)
    if dims.cp > 1:  # the ring: 3 collectives per attention call (traffic.ring_bytes)
        out["cp"] = out.get("cp", 0) + 3 * m * layers
    if dims.dp_replicate > 1:
        out["dp_replicate"] = layers + 1
    if dims.pp > 1:
        out["pp"] = 2 * m * len(stages)
    return out


def step_time(args, dims, traffic: dict[str, int], hw: Hardware, *, seq_len: int, batch_size: int,
              global_rank: int, ac_mode: str = "none", ac_every: int = 2) -> StepTime:
    c = rank_coords(dims, global_rank)
    stages = stages_of(dims, c["pp"])
    tokens = batch_size // dims.dp * seq_len // dims.cp  # a cp rank's share; attention still spans seq_len
    kw = dict(seq_len=seq_len, ac_mode=ac_mode, ac_every=ac_every)
    over = oversubscription(dims, hw)
    m = dims.microbatches if dims.pp > 1 else 1
    n_params = sum(len(stage_params(args, dims, s, c["tp"])) for s in stages)
    step_ops = n_params * OPS_PER_PARAM  # the optimizer and the norm/clip, once a step
    sharded = dims.dp_shard * dims.cp > 1 or dims.tp > 1  # parameters are DTensors
    opt_host = over * step_ops * (hw.dtensor_op_s if sharded else hw.op_s)
    bubble = 0.0
    if dims.pp == 1:
        plain, dt = host_ops(args, dims, 0, ac_mode=ac_mode, ac_every=ac_every)
        mb_host = over * (plain * hw.op_s + dt * hw.dtensor_op_s)
        host = mb_host * m + opt_host
        compute = over * tokens * stage_flops_per_token(args, dims, 0, **kw) / hw.flop_rate + host
    else:
        from plait.pipelining.schedules import Costs, build_schedule, simulate

        per_stage = [stage_flops_per_token(args, dims, s, **kw) for s in range(dims.num_stages)]
        ops = [host_ops(args, dims, s, ac_mode=ac_mode, ac_every=ac_every) for s in range(dims.num_stages)]
        mb_host = over * sum(p * hw.op_s + d * hw.dtensor_op_s for p, d in ops) / len(ops)
        fwd = over * tokens / m * sum(per_stage) / len(per_stage) / hw.flop_rate / 3 + mb_host / 3
        backward = 3 * fwd if ac_mode != "none" else 2 * fwd
        plan = build_schedule(dims.pp_schedule, dims.pp, dims.microbatches,
                              stages_per_rank=dims.virtual_stages if dims.virtual_stages > 1 else None)
        sim = simulate(plan, Costs(forward=fwd, backward=backward, weight=fwd))
        compute, bubble = sim.makespan + opt_host, sim.bubble
        host = mb_host * m * len(stages) + opt_host
    ops = _ops(dims, args, stages)
    comm: dict[str, float] = {}
    sizes = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
             "tp": dims.tp, "pp": 2}
    for axis, nbytes in traffic.items():
        names = axis.split("+")
        n_ops = sum(v for k, v in ops.items() if k in names) or 3
        group = 1
        for k in names:
            group *= sizes.get(k, 2)
        comm[axis] = nbytes / hw.bandwidth + n_ops * hw.latency * max(1, group - 1)
    # the ring's all-gather runs before its blocks compute: on the critical path, as tp and pp are
    ring = ring_bytes(args, dims, [i for s in stages for i in dims.stage_layers[s]], seq_len=seq_len,
                      batch_size=batch_size, ac_mode=ac_mode, ac_every=ac_every) / hw.bandwidth
    critical = sum(v for k, v in comm.items() if "tp" in k.split("+") or k == "pp") + ring
    dp = sum(v for k, v in comm.items() if not ("tp" in k.split("+") or k == "pp")) - ring
    exposed = critical + max(0.0, dp - hw.overlap * compute)
    return StepTime(compute, host, comm, exposed, bubble, compute + exposed)
