"""Peak bytes one rank holds during a step, by component (torch-free, fp32 as plait train runs).

    ModelArgs + ParallelDims + AC mode + rank -> shapes (the rank's stages and parameters)
    -> state: parameters, gradients, AdamW (exp_avg, exp_avg_sq, one float32 step per param)
       on the rank's shards (FSDP: its real rows; TP: its local pieces)
    -> unsharded FSDP groups alive at the peak: pp = 1, the root group and two blocks (the one
       running and the one prefetched); pp > 1, every group of the stage (plait.pipelining
       keeps them unsharded for the whole step)
    -> activations: per block and microbatch (formula below), times the microbatches in flight
       (the schedule simulator's peak for the rank, pp > 1), plus the logits on the last stage
    -> communication buffers: FSDP's reduce-scatter input (the largest group, unsharded) and
       all-gather input; DDP's gradient buckets (a copy of the grads)

Activations saved per block for T = mb * s tokens (t = tp, T' = T/t under SP, else T;
h, kv heads, hd head_dim, f the SwiGLU width; 4 bytes each):
    norms and residual stream      4 * T' * d        (two norm inputs, two norm outputs)
    projection inputs              2 * T * d         (attention and MLP inputs, gathered under SP)
    q, k, v and their rotations    2 * T * (h + 2 kv) * hd / t
    repeated k, v, SDPA output     3 * T * h * hd / t  (+ wo's input, the same again)
    attention probabilities        mb * h/t * s * s  (CPU SDPA's math path keeps them)
    SwiGLU                         4 * T * f / t     (w1 and w3 outputs, silu, their product)
A checkpointed block keeps only its input, T' * d; while one recomputes, its full set is
alive once more. The logits: 3 * T * V / t (logits, log-softmax, their grad).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plait.plan.shapes import fsdp_groups, rank_coords, stage_params, stages_of

F32 = 4


@dataclass(frozen=True)
class Memory:
    params: int
    grads: int
    optimizer: int
    unsharded: int  # FSDP groups gathered at the peak
    activations: int
    buffers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.unsharded + self.activations + self.buffers

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "unsharded": self.unsharded, "activations": self.activations, "buffers": self.buffers,
                "total": self.total}


def block_activations(args, *, tokens: int, mb: int, seq_len: int, tp: int, sp: bool) -> int:
    """Bytes one block saves for backward for one microbatch (module docstring)."""
    d, h, kv, hd, f, t = args.dim, args.n_heads, args.kv_heads, args.head_dim, args.ffn_hidden_dim(), tp
    local = tokens // t if sp else tokens
    elems = (4 * local * d + 2 * tokens * d + 2 * tokens * (h + 2 * kv) * hd // t
             + 4 * tokens * h * hd // t + mb * (h // t) * seq_len * seq_len + 4 * tokens * f // t)
    return elems * F32


@lru_cache(maxsize=4096)
def peak_in_flight(dims, pp_rank: int) -> int:
    """Microbatches whose activations the rank holds at once (the simulator's peak)."""
    if dims.pp == 1:
        return 1
    from plait.pipelining.schedules import build_schedule, simulate

    plan = build_schedule(dims.pp_schedule, dims.pp, dims.microbatches,
                          stages_per_rank=dims.virtual_stages if dims.virtual_stages > 1 else None)
    return simulate(plan).peak_in_flight_per_rank[pp_rank]


def memory_per_rank(args, dims, *, seq_len: int, batch_size: int, global_rank: int, ac_mode: str = "none",
                    ac_every: int = 2) -> Memory:
    c = rank_coords(dims, global_rank)
    n, t = dims.dp_shard, dims.tp
    m = dims.microbatches if dims.pp > 1 else 1
    mb = batch_size // dims.dp // m
    tokens = mb * seq_len
    sp = dims.sequence_parallel and t > 1
    params = unsharded = buffers = acts = 0
    n_params = 0
    stages = stages_of(dims, c["pp"])
    per_block_max = 0
    for stage in stages:
        ps = stage_params(args, dims, stage, c["tp"])
        n_params += len(ps)
        if n > 1:
            params += sum(p.fsdp_local(n, c["dp_shard"]) for p in ps) * F32
            groups = sorted((sum(p.fsdp_padded(n) for p in g) * n * F32, g[0].block is None)
                            for g in fsdp_groups(ps))
            if dims.pp > 1:
                unsharded += sum(b for b, _ in groups)
            else:
                root = sum(b for b, is_root in groups if is_root)
                blocks = sorted((b for b, is_root in groups if not is_root), reverse=True)
                unsharded += root + sum(blocks[:2])
            largest = max(b for b, _ in groups)
            buffers = max(buffers, largest + largest // n)
        else:
            local = sum(p.numel for p in ps) * F32
            params += local
            if dims.dp_replicate > 1:
                buffers += local
        block = block_activations(args, tokens=tokens, mb=mb, seq_len=seq_len, tp=t, sp=sp)
        per_block_max = max(per_block_max, block)
        for i in dims.stage_layers[stage]:
            kept = ac_mode == "full" or (ac_mode == "every" and i % ac_every == 0)
            acts += (tokens // t if sp else tokens) * args.dim * F32 if kept else block
        if stage == dims.num_stages - 1:
            acts += 3 * tokens * (args.vocab_size // t) * F32
    in_flight = peak_in_flight(dims, c["pp"])
    if stages:
        acts = acts * in_flight // len(stages)  # in-flight microbatches over the rank's stages
    if ac_mode != "none":
        acts += per_block_max  # one block recomputing
    return Memory(params=params, grads=params, optimizer=2 * params + n_params * F32, unsharded=unsharded,
                  activations=acts, buffers=buffers)
