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
       output; DDP's gradient buckets (a copy of the grads; pp = 1 only: pp turns DDP's sync off)
    -> the walk (working_peak): the rank's schedule actions in order, F adding a microbatch's
       activations, B holding in turn the loss's gradients, a block's backward working set
       (and its recompute under AC), FSDP's reduce-scatter buffers, then freeing the microbatch
       and leaving the stage's gradients (FSDP under pp: unsharded, summed to the step's end)

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
alive once more. Peak = parameters + optimizer + unsharded + DDP's buckets + the walk's peak:
what plait.train.live_bytes counts, each term found live at the measured peak on the tiny
config (tests/plan/test_live.py). Under pp the last stage also keeps each microbatch's logits
to the step's end (the schedule returns them).
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
    activations: int  # saved for backward at the most microbatches in flight
    buffers: int
    working: int  # activations + gradients + backward's working sets (FSDP's reduce buffers) at their joint peak
    total: int  # params + optimizer + unsharded + DDP's buckets + working: the peak

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "unsharded": self.unsharded, "activations": self.activations, "buffers": self.buffers,
                "working": self.working, "total": self.total}


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


@lru_cache(maxsize=4096)
def rank_actions(dims, pp_rank: int) -> tuple[tuple[int, str], ...]:
    """The rank's compute actions in order, as (stage, "F" | "B"): pp = 1 runs F then B."""
    if dims.pp == 1:
        return ((0, "F"), (0, "B"))
    from plait.pipelining.schedules import build_schedule

    plan = build_schedule(dims.pp_schedule, dims.pp, dims.microbatches,
                          stages_per_rank=dims.virtual_stages if dims.virtual_stages > 1 else None)
    return tuple((a.stage, "F" if a.kind.value == "F" else "B") for a in plan.actions[pp_rank]
                 if a.kind.value in ("F", "B"))


def block_backward(args, *, tokens: int, tp: int) -> int:
    """Bytes a block's backward makes at its widest, beside the saved activations: three T x f/tp
    (the gradients of w1's and w3's outputs and of silu's) and four T x d (the incoming gradient,
    the residual's sum, w2's input gradient and the norm's), counted at a block's backward."""
    return (3 * tokens * args.ffn_hidden_dim() // tp + 4 * tokens * args.dim) * F32


def loss_gradients(args, dims, *, tokens: int) -> int:
    """Bytes the loss's backward holds beside the saved activations, at the start of the last
    stage's backward: the gradients of log_softmax's output and of the logits (T x V, float32);
    under loss_parallel (vocab-sharded logits) also exp(logits - max) and the one-hot mask's
    zeros, four T x V/tp in all (counted by plait.train.live_bytes at that op)."""
    t = dims.tp
    if t > 1 and dims.loss_parallel:
        return 4 * tokens * (args.vocab_size // t) * F32
    return 2 * tokens * args.vocab_size * F32


@dataclass(frozen=True)
class StageCost:
    """One stage on one rank, for the walk: bytes per microbatch unless said."""
    acts: int  # saved for backward by the stage
    extras: int  # of those, the part outside the blocks freed before the blocks' backward (the head)
    block: int  # one block's saved activations (the first freed in backward)
    grads: int  # the stage's gradients, alive from its first backward to the step's end
    loss: int  # the loss's backward at the start of the stage's backward (last stage)
    block_backward: int  # a block's backward: its intermediate gradients, plus the recompute under AC
    reduce: int  # FSDP (pp = 1): the reduce-scatter's unsharded grads and output, after a block's backward
    kept: int  # held to the step's end per microbatch (pp > 1, last stage: the logits the schedule returns)


def working_peak(dims, pp_rank: int, costs: dict[int, StageCost]) -> int:
    """The most bytes activations, gradients and backward's working sets hold at once: walking
    the rank's actions, an F adds its stage's saved activations (one microbatch); a B holds, in
    turn, (1) everything so far plus the loss's gradients, (2) less the head's activations, plus
    the last block's backward working set, (3) less that block's activations too, plus FSDP's
    reduce-scatter buffers; it ends freeing the microbatch's activations, and the stage's
    gradients exist from then on (accumulated in place by later microbatches)."""
    held = present = peak = 0
    seen: set[int] = set()
    for stage, kind in rank_actions(dims, pp_rank):
        c = costs[stage]
        if kind == "F":
            held += c.acts + c.kept
            peak = max(peak, held + present)
            continue
        base = held + present
        peak = max(peak, base + c.loss, base - c.extras + c.block_backward,
                   base - c.extras - c.block + c.reduce)
        held -= c.acts
        if stage not in seen:
            seen.add(stage)
            present += c.grads
        peak = max(peak, held + present)
    return peak


def memory_per_rank(args, dims, *, seq_len: int, batch_size: int, global_rank: int, ac_mode: str = "none",
                    ac_every: int = 2) -> Memory:
    c = rank_coords(dims, global_rank)
    n, t = dims.dp_shard * dims.cp, dims.tp  # FSDP shards over the flattened (dp_shard, cp) axis
    m = dims.microbatches if dims.pp > 1 else 1
    mb = batch_size // dims.dp // m
    seq_len //= dims.cp  # context parallel: this rank's 2 of 2*cp chunks of each sequence
    tokens = mb * seq_len
    sp = dims.sequence_parallel and t > 1
    params = unsharded = buffers = 0
    n_params = 0
    stages = stages_of(dims, c["pp"])
    per_block_max = 0
    costs: dict[int, StageCost] = {}
    ddp = 0
    for stage in stages:
        ps = stage_params(args, dims, stage, c["tp"])
        n_params += len(ps)
        last = stage == dims.num_stages - 1
        if n > 1:
            local = sum(p.fsdp_local(n, c["fsdp"]) for p in ps) * F32
            groups = sorted((sum(p.fsdp_padded(n) for p in g) * n * F32, g[0].block is None)
                            for g in fsdp_groups(ps))
            if dims.pp > 1:
                # the stage's groups stay unsharded for the step, and their unsharded grads
                # are summed over the microbatches, reduce-scattered at the last backward
                unsharded += sum(b for b, _ in groups)
                grads = sum(b for b, _ in groups)
            else:
                root = sum(b for b, is_root in groups if is_root)
                blocks = sorted((b for b, is_root in groups if not is_root), reverse=True)
                unsharded += root + sum(blocks[:2])
                grads = local
            largest = max(b for b, _ in groups)
            reduce = largest + largest // n
            buffers = max(buffers, reduce)
        else:
            local = sum(p.numel for p in ps) * F32
            grads, reduce = local, 0
            if dims.dp_replicate > 1 and dims.pp == 1:
                ddp += local  # the buckets: a flat copy of the grads (pp > 1 turns DDP's sync off: unused)
        params += local
        block = block_activations(args, tokens=tokens, tp=t, sp=sp)
        per_block_max = max(per_block_max, block)
        extras = stage_activations(args, tokens=tokens, seq_len=seq_len, tp=t, sp=sp, first=stage == 0, last=last)
        acts = extras
        layers = dims.stage_layers[stage]
        for i in layers:
            ck = ac_mode == "full" or (ac_mode == "every" and i % ac_every == 0)
            acts += (tokens // t if sp else tokens) * args.dim * F32 if ck else block
        last_ck = bool(layers) and (ac_mode == "full" or (ac_mode == "every" and layers[-1] % ac_every == 0))
        work = block_backward(args, tokens=tokens, tp=t) if layers else 0
        costs[stage] = StageCost(
            acts=acts, extras=extras if last else 0, block=0 if not layers or last_ck else block, grads=grads,
            loss=loss_gradients(args, dims, tokens=tokens) if last else 0,
            block_backward=work + (block if last_ck else 0), reduce=reduce,
            kept=tokens * (args.vocab_size // t) * F32 if last and dims.pp > 1 else 0)
    in_flight = peak_in_flight(dims, c["pp"])
    saved = sum(x.acts for x in costs.values()) * in_flight // len(stages) if stages else 0  # spread over the stages
    if ac_mode != "none":
        saved += per_block_max  # one block recomputing
    working = working_peak(dims, c["pp"], costs) if stages else 0
    return Memory(params=params, grads=sum(x.grads for x in costs.values()), optimizer=2 * params + n_params * F32,
                  unsharded=unsharded, activations=saved, buffers=buffers + ddp,
                  working=working, total=params + 2 * params + n_params * F32 + unsharded + ddp + working)
