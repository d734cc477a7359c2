"""Peak bytes one rank holds during a step, by component (torch-free, fp32 as plait train runs).

    ModelArgs + ParallelDims + AC mode + rank -> shapes (the rank's stages and parameters)
    -> state, alive all step: parameters and AdamW (exp_avg, exp_avg_sq, one float32 step per
       param) on the rank's shards (FSDP: its real rows; TP: its local pieces); DDP's buckets
       (a flat copy of the grads; pp = 1 only: under pp DDP's own sync is off)
    -> per stage (StageCost): one microbatch's saved activations (formula below); its grads,
       alive from its first B (FSDP under pp: unsharded, summed to the step's end); the moments
       of its backward, each (activations freed by then, bytes held beside them):
         the loss's   the logits' gradients (loss_gradients)
         last block   the head's activations freed; its feed-forward backward's working set
                      (block_backward; AC: plus the block's recompute); the head's grads
         block before the last block's activations freed too; its working set again, the last
                      one's reduce-scatter in flight (FSDP)
         attention    context parallel: the same two blocks once their feed-forward is freed and
                      its grads made, while the ring's backward runs (ring_backward)
    -> FSDP's unsharded groups: pp = 1, the root's alone through forward's end and the loss's
       backward (the last block is gathered when the logits' grad arrives), the last block's
       and the one before's (prefetched: the all-gather's output and input) in the last block's
       backward, one block beside the root after it; pp > 1, every group of the rank's stages
       for the whole step (plait.pipelining keeps them unsharded)
    -> the walk (working_peak): the rank's schedule actions in order (pp = 1: F then B); an F
       adds a microbatch's activations (pp's last stage also keeps its logits to the step's end:
       the schedule returns them), a B passes its moments, frees them and leaves its grads
    Peak = parameters + optimizer + DDP's buckets + the walk's largest figure.

Every term is what plait.train.live_bytes (every op's outputs and saved tensors, by storage)
found live at the measured peak of a layout of tests/plan/test_live.py on the tiny config.

Activations: the tensors autograd saves, as listed by saved_tensors_hooks on the tiny model
(unique storages, parameters left out); T = mb * s tokens, t = tp, T' = T/t under SP else T,
h heads, hd head_dim, f the SwiGLU width; float32 unless said:
    per block    3 T' d   attention_norm's input and x * rstd, ffn_norm's x * rstd
                 2 T d    the projections' inputs (all-gathered under SP)
                 5 T h hd / t   q, k and v (k, v repeated to h heads), SDPA's output, wo's input
                 4 T f / t      w1 and w3 outputs, silu, w2's input
                 2 T' + T h / t   the norms' rstd, SDPA's logsumexp (CPU's fused kernel: no s x s)
    per stage    the token ids (int64, first stage); the rotary table (a buffer, whole: its
                 slices are views); on the last stage
                 the final norm (2 T' d + T d + T'), the logits T V / t, the int64 targets;
                 TP without SP: one T d more (the output's replicated input)
Context parallel: every figure above on T = mb * s/cp tokens (each cp rank's chunks; the ring
saves q, k, v, out and lse as SDPA does); FSDP shards over dp_shard * cp ranks.
A checkpointed block keeps only its input, T' * d; while one recomputes, its full set is
alive once more. `Memory.activations` is the saved activations alone at the most microbatches
in flight (what tests/plan/test_measured.py compares with saved_tensors_hooks).
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
    working: int  # activations + gradients + backward's working sets + FSDP's buffers, at their joint peak
    total: int  # params + optimizer + DDP's buckets + working (with the unsharded groups then): the peak

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
    out = args.max_seq_len * args.head_dim * F32  # the rotary table: (max_seq_len, hd/2) pairs of floats
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
    """Bytes a block's backward holds at its widest beyond its saved activations: in the
    feed-forward's backward, the gradients of w2's input, of silu's output and of w3's output
    (three T x f/tp) are alive while w2's saved input is already freed (net two), beside the
    incoming gradient and the residual's (two T x d), as live_bytes finds it."""
    return (2 * tokens * args.ffn_hidden_dim() // tp + 2 * tokens * args.dim) * F32


def ring_backward(args, *, tokens: int, seq_len: int, tp: int, cp: int) -> int:
    """Bytes context parallel's ring attention (allgather rotation) holds in its backward, with
    n = T h hd/tp the elements of this rank's q, of its k (repeated to h heads) and of its v:
    q and dout as contiguous fp32 views and dq (3n), the gathered K/V and every rank's fp32
    dK/dV (2 x cp x 2n), the local K/V packed, one step's dk, dv, their pack and the
    reduce-scatter's output (4 x 2n); and one block's scores, probabilities and their two
    gradients (4 x mb h/tp (s/2)^2: the causal load balance splits each sequence's local
    tokens s into two chunks) beside its dq, dk, dv (3 x mb h/tp (s/2) hd)."""
    if cp == 1:
        return 0
    h, hd = args.n_heads // tp, args.head_dim
    n, half, mb = tokens * h * hd, seq_len // 2, tokens // seq_len
    return (3 * n + 2 * cp * 2 * n + 4 * 2 * n + 4 * mb * h * half * half + 3 * mb * h * half * hd) * F32


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
    grads: int  # the stage's gradients, alive from its first backward to the step's end
    kept: int  # held to the step's end per microbatch (pp > 1, last stage: the logits the schedule returns)
    forward: int  # held beside the activations while forward runs (FSDP: the root's unsharded group)
    # moments of one backward, each (bytes of this microbatch's activations freed by then,
    # bytes held beside them then): the loss's; the last block's (its working set); the
    # block before's (the last one's reduce-scatter in flight)
    moments: tuple[tuple[int, int], ...]


def working_peak(dims, pp_rank: int, costs: dict[int, StageCost]) -> int:
    """The most bytes activations, gradients and backward's working sets hold at once: walking
    the rank's actions, an F adds its stage's saved activations (one microbatch); a B passes
    its moments, then frees the microbatch's activations, and the stage's gradients exist from
    then on (accumulated in place by later microbatches). Checked after each F, at each
    moment and after each B."""
    held = present = peak = 0
    seen: set[int] = set()
    for stage, kind in rank_actions(dims, pp_rank):
        c = costs[stage]
        if kind == "F":
            held += c.acts + c.kept
            peak = max(peak, held + present + c.forward)
            continue
        peak = max([peak] + [held + present - freed + extra for freed, extra in c.moments])
        held -= c.acts
        if stage not in seen:
            seen.add(stage)
            present += c.grads
        peak = max(peak, held + present + c.forward)
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
    parts: dict[int, tuple] = {}
    ddp = 0
    reduce = 0
    phases = (0, 0, 0)  # FSDP's unsharded bytes at forward's end / the last block's backward / the one before's
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
                # the last block's backward: the block before is being gathered (the all-gather's
                # output, one group, and its input, the rank's shard of it)
                phases = (root, unsharded + sum(blocks[1:2]) // n, root + sum(blocks[1:3]))
                grads = local
            largest = max(b for b, _ in groups)
            reduce = largest + largest // n
            buffers = max(buffers, reduce)
        else:
            local = sum(p.numel for p in ps) * F32
            grads = local
            if dims.dp_replicate > 1 and dims.pp == 1:
                ddp += local  # the buckets: a flat copy of the grads (pp > 1 turns DDP's sync off: unused)
        params += local
        block = block_activations(args, tokens=tokens, tp=t, sp=sp)
        per_block_max = max(per_block_max, block)
        extras = stage_activations(args, tokens=tokens, seq_len=seq_len, tp=t, sp=sp, first=stage == 0, last=last)
        layers = dims.stage_layers[stage]
        ck = [ac_mode == "full" or (ac_mode == "every" and i % ac_every == 0) for i in layers]
        kept_in = (tokens // t if sp else tokens) * args.dim * F32  # a checkpointed block keeps its input
        held = [kept_in if k else block for k in ck]  # per block, in layer order
        recompute = [block if k else 0 for k in ck]
        head = extras if last else 0  # the head's activations go first in backward
        # the feed-forward's saved activations (w1, w3 outputs, silu, w2's input; its normed
        # input; the norm's x * rstd) and weights' gradients: gone / made before attention's backward
        ffn_acts = (4 * tokens * args.ffn_hidden_dim() // t + tokens * args.dim + (tokens // t if sp else tokens)
                    * args.dim) * F32
        ffn_grads = 3 * args.ffn_hidden_dim() * args.dim // t * F32
        # the head's gradients (output, final norm) exist from the loss's backward on; FSDP
        # reduce-scatters the root group's only at the end of backward
        head_grads = sum(p.numel for p in ps if p.block is None and p.name != "tok_embeddings.weight") * F32
        parts[stage] = (extras + sum(held), grads, head, head_grads, ffn_acts, ffn_grads, held, recompute, reduce, phases,
                        loss_gradients(args, dims, tokens=tokens) if last else 0,
                        tokens * (args.vocab_size // t) * F32 if last and dims.pp > 1 else 0)
    work = block_backward(args, tokens=tokens, tp=t)
    ring = ring_backward(args, tokens=tokens, seq_len=seq_len, tp=t, cp=dims.cp)
    for stage, (acts, grads, head, head_grads, ffn_acts, ffn_grads, held, recompute, reduce, phases, loss,
                kept) in parts.items():
        if dims.pp > 1:  # every group of the rank's stages, the whole step; reduced once, after the last B
            phases, reduce = (unsharded,) * 3, 0
        moments = [(0, loss + phases[0])]
        if held:
            moments.append((head, head_grads + recompute[-1] + work + phases[1]))
            # the block before runs while the last one's reduce-scatter is in flight (FSDP)
            before = (recompute[-2] + work) if len(held) > 1 else 0
            moments.append((head + held[-1], head_grads + before + reduce + phases[2]))
            if ring:  # the last block's attention backward, and the one before's (a reduce-scatter in flight)
                for k, u in ((-1, phases[1]), (-2, phases[2] + reduce)):
                    if len(held) < -k:
                        break
                    gone = head + sum(held[k + 1:]) if k < -1 else head
                    ck = recompute[k] > 0
                    moments.append((gone + (0 if ck else ffn_acts),
                                    head_grads + ffn_grads + ring + (recompute[k] - ffn_acts if ck else 0) + u))
        costs[stage] = StageCost(acts=acts, grads=grads, kept=kept, forward=phases[0], moments=tuple(moments))
    in_flight = peak_in_flight(dims, c["pp"])
    saved = sum(x.acts for x in costs.values()) * in_flight // len(stages) if stages else 0  # spread over the stages
    if ac_mode != "none":
        saved += per_block_max  # one block recomputing
    working = working_peak(dims, c["pp"], costs) if stages else 0
    return Memory(params=params, grads=sum(x.grads for x in costs.values()), optimizer=2 * params + n_params * F32,
                  unsharded=unsharded, activations=saved, buffers=buffers + ddp,
                  working=working, total=params + 2 * params + n_params * F32 + ddp + working)
