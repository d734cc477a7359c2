"""Step time from a roofline: compute at a FLOP rate, plus exposed communication, plus the
pipeline's bubble from the schedule simulator (torch-free).

    FLOPs per rank = tokens per rank * (6 * N_local + 12 * L * h/t * hd * s)   torchtitan's count:
        N_local the rank's TP-local block and output parameters (no embedding table), L its
        layers; activation checkpointing reruns forward: 8 instead of 6 on checkpointed blocks
    compute_s   = FLOPs / flop_rate                                     pp = 1
                = makespan of plait.pipelining's simulator with F = forward time of one
                  microbatch on one stage, B = 2F (3F with AC), W = F  pp > 1 (bubble included)
    comm_s(ax)  = bytes(ax) / bandwidth + ops(ax) * latency             per axis, traffic.py's bytes
    exposed     = tp + pp + cp's ring (on the critical path: the ring gathers K/V before its
                  blocks compute) + max(0, dp - overlap * compute_s)
    cp: a rank's tokens are B/dp * s/cp; each still attends over the whole sequence s
                  (FSDP/DDP gathers and reductions overlap compute, up to `overlap` of it)
    step_s      = compute_s + exposed

Defaults (no --calibrate): 5e10 FLOP/s per rank (fp32 matmuls on a few CPU cores), Gloo
1e9 B/s and 50 us per collective on one host, overlap 0.5. `--calibrate` measures the first
three on this machine (calibrate.py): the FLOP rate as one block's forward + backward runs it,
per-op overhead included. Not modelled: DTensor's dispatch overhead per op under TP, which on
the tiny model dominates a TP step (tests/plan's figures: TP steps 5-10x the prediction).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from plait.plan.shapes import rank_coords, stages_of
from plait.plan.traffic import ring_bytes


@dataclass(frozen=True)
class Hardware:
    flop_rate: float = 5e10  # FLOP/s per rank
    bandwidth: float = 1e9  # bytes/s a rank sends on a collective
    latency: float = 50e-6  # seconds per collective
    overlap: float = 0.5  # fraction of compute that can hide data-parallel communication
    source: str = "defaults"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: dict[str, float]
    exposed_s: float
    bubble: float
    step_s: float

    def dominant(self) -> str:
        """What the step spends most on: "compute", "bubble" or the axis of the most comm."""
        parts = {"compute": self.compute_s * (1 - self.bubble), "bubble": self.compute_s * self.bubble}
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
    bubble = 0.0
    if dims.pp == 1:
        compute = tokens * stage_flops_per_token(args, dims, 0, **kw) / hw.flop_rate
    else:
        from plait.pipelining.schedules import Costs, build_schedule, simulate

        per_stage = [stage_flops_per_token(args, dims, s, **kw) for s in range(dims.num_stages)]
        fwd = tokens / dims.microbatches * sum(per_stage) / len(per_stage) / hw.flop_rate / 3
        backward = 3 * fwd if ac_mode != "none" else 2 * fwd
        plan = build_schedule(dims.pp_schedule, dims.pp, dims.microbatches,
                              stages_per_rank=dims.virtual_stages if dims.virtual_stages > 1 else None)
        sim = simulate(plan, Costs(forward=fwd, backward=backward, weight=fwd))
        compute, bubble = sim.makespan, sim.bubble
    ops = _ops(dims, args, stages)
    comm: dict[str, float] = {}
    for axis, nbytes in traffic.items():
        n_ops = sum(v for k, v in ops.items() if k in axis.split("+")) or 3
        comm[axis] = nbytes / hw.bandwidth + n_ops * hw.latency
    # the ring's all-gather runs before its blocks compute: on the critical path, as tp and pp are
    ring = ring_bytes(args, dims, [i for s in stages for i in dims.stage_layers[s]], seq_len=seq_len,
                      batch_size=batch_size, ac_mode=ac_mode, ac_every=ac_every) / hw.bandwidth
    critical = sum(v for k, v in comm.items() if "tp" in k.split("+") or k == "pp") + ring
    dp = sum(v for k, v in comm.items() if not ("tp" in k.split("+") or k == "pp")) - ring
    exposed = critical + max(0.0, dp - hw.overlap * compute)
    return StepTime(compute, comm, exposed, bubble, compute + exposed)
