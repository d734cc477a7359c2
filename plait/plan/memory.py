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

Activations: the tensors autograd saves, as listed by saved_tensors_hooks on the tiny model
(unique storages, parameters left out); T = mb * s tokens, t = tp, T' = T/t under SP else T,
h heads, hd head_dim, f the SwiGLU width; float32 unless said:
    per block    3 T' d   attention_norm's input and x * rstd, ffn_norm's x * rstd
                 2 T d    the projections' inputs (all-gathered under SP)
                 5 T h hd / t   q, k and v (k, v repeated to h heads), SDPA's output, wo's input
                 4 T f / t      w1 and w3 outputs, silu, w2's input
                 2 T' + T h / t   the norms' rstd, SDPA's logsumexp (CPU's fused kernel: no s x s)
    per stage    the token ids (int64, first stage); the rotary table slice; on the last stage
                 the final norm (2 T' d + T d + T'), the logits T V / t, the int64 targets;
                 TP without SP: one T d more (the output's replicated input)
Context parallel: every figure above on T = mb * s/cp tokens (each cp rank's chunks; the ring
saves q, k, v, out and lse as SDPA does); FSDP shards over dp_shard * cp ranks.
A checkpointed block keeps only its input, T' * d; while one recomputes, its full set is
alive once more. Peak = parameters + optimizer + max(activations, gradients) + unsharded +
buffers: activations are freed through backward while the gradients fill in.
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
        return self.params + self.optimizer + max(self.activations, self.grads) + self.unsharded + self.buffers

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "unsharded": self.unsharded, "activations": self.activations, "buffers": self.buffers,
                "total": self.total}


def block_activations(args, *, tokens: int, tp: int, sp: bool) -> int:
    """Bytes one block saves for backward for one microbatch of `tokens` tokens."""
    d, h, hd, f, t = args.dim, args.n_heads, args.head_dim, args.ffn_hidden_dim(), tp
    local = tokens // t if sp else tokens
    elems = (3 * local * d + 2 * tokens * d + 5 * tokens * h * hd // t + 4 * tokens * f // t
             + 2 * local + tokens * h // t)
    return elems * F32


def stage_activations(args, *, tokens: int, seq_len: int, tp: int, sp: bool, first: bool, last: bool) -> int:
    """Bytes a stage saves outside its blocks for one microbatch (module docstring)."""
    d, t = args.dim, tp
    local = tokens // t if sp else tokens
    out = (seq_len * args.head_dim // 2) * F32  # the rotary table's rows for this sequence
    if first:
        out += (tokens + tokens // seq_len) * 8  # int64 ids: the (mb, s + 1) window the input views
    if last:
        out += (2 * local * d + tokens * d + local + tokens * (args.vocab_size // t)) * F32 + tokens * 8
        if t > 1 and not sp:
            out += tokens * d * F32
    return out


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
    n, t = dims.dp_shard * dims.cp, dims.tp  # FSDP shards over the flattened (dp_shard, cp) axis
    m = dims.microbatches if dims.pp > 1 else 1
    mb = batch_size // dims.dp // m
    seq_len //= dims.cp  # context parallel: this rank's 2 of 2*cp chunks of each sequence
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
            params += sum(p.fsdp_local(n, c["fsdp"]) for p in ps) * F32
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
        block = block_activations(args, tokens=tokens, tp=t, sp=sp)
        per_block_max = max(per_block_max, block)
        for i in dims.stage_layers[stage]:
            kept = ac_mode == "full" or (ac_mode == "every" and i % ac_every == 0)
            acts += (tokens // t if sp else tokens) * args.dim * F32 if kept else block
        acts += stage_activations(args, tokens=tokens, seq_len=seq_len, tp=t, sp=sp, first=stage == 0,
                                  last=stage == dims.num_stages - 1)
    in_flight = peak_in_flight(dims, c["pp"])
    if stages:
        acts = acts * in_flight // len(stages)  # in-flight microbatches over the rank's stages
    if ac_mode != "none":
        acts += per_block_max  # one block recomputing
    return Memory(params=params, grads=params, optimizer=2 * params + n_params * F32, unsharded=unsharded,
                  activations=acts, buffers=buffers)
