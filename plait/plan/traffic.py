"""Bytes each rank sends in one steady-state training step, per mesh axis (torch-free).

    ModelArgs + ParallelDims + AC mode + global rank -> the collectives plait issues
    (listed below) -> bytes counted as plait.comm counts them -> {axis label: bytes}

Counting is plait.comm's (a ring model, per rank, truncated to int per op): all-reduce
2(n-1)/n * S; all-gather (n-1) * piece (native) or 2(n-1)/n * full (the all-reduce form
Gloo takes past 32 MiB); reduce-scatter (n-1) * piece; broadcast S on the root; send S.
Labels are plait.train.metrics.axis_label's: the axes of size > 1 a group spans.

Per step (B global batch, dp = dp_replicate * dp_shard, b = B/dp, m microbatches, mb = b/m,
s = seq_len / cp the tokens of a sequence a rank holds, d dim, t tp; fp32 throughout, as plait
train runs):
  FSDP (n = dp_shard * cp > 1: over the flattened ("dp_shard", "cp") axis), per group of S padded elements (shapes.py): pp = 1, an all-gather
    (n-1)*4S in forward, again in backward for blocks (reshard_after_forward; the root keeps
    its parameters), one reduce-scatter (n-1)*4S; pp > 1, one all-gather and one
    reduce-scatter per group per step (plait.pipelining.fully_sharded). HSDP adds an
    all-reduce of the 4S shard over dp_replicate.
  DDP (dp_replicate > 1, dp_shard = 1): one all-reduce of the stage's local grads (pp > 1: per
    stage; pp = 1: per bucket, 1 MiB first then 25 MiB; the sum is exact when dp_replicate
    divides 2 * bytes). No buffer broadcast: torch's replicate (which plait train uses) syncs no
    buffers, and the rotary table is the same on every rank anyway.
  TP+SP, per microbatch, X = (t-1) * mb * s/t * d * 4: per block forward 2 all-gathers and 2
    reduce-scatters, backward the same; a recomputed block (AC) 2 all-gathers and 1
    reduce-scatter more (the recompute stops after the last saved tensor: w2's reduce-scatter
    never reruns); embedding a reduce-scatter forward and an all-gather backward; output the
    reverse. Per step, the SP norms' Partial grads: an all-reduce of d * 4 per norm (per
    microbatch with FSDP under a pipeline: its accumulation makes each microbatch's Replicate).
  TP alone, Y = 2(t-1)/t * mb * s * d * 4: per block 2 all-reduces forward, 2 backward, 1 per
    recomputed block; embedding one forward; output one backward.
  loss_parallel (last stage, t > 1), per microbatch: 3 all-reduces of mb * s floats; without
    it the logits' all-gather, (t-1) * mb * s * V/t * 4 (not measured yet).
  CP ring attention (ring_bytes, the "allgather" rotation plait train keeps), per attention
    call and microbatch, KV = 2 * mb * h/t * s * hd * 4 (K, V repeated to the local heads,
    packed): forward an all-gather (cp-1) * KV, backward another and a reduce-scatter of the
    fp32 dK/dV (cp-1) * KV; a recomputed block's forward one all-gather more.
  PP, per microbatch: each stage but the last sends its output forward, each but the first
    its input grad back: mb * s * d * 4 bytes (mb * s/t * d * 4 under SP).
  The trainer, per step on the world: grad-norm and loss (float64) and peak memory (float32).
The first step sends a little more (pipeline shape metadata, DDP's bucket rebuild): not counted.
"""

from __future__ import annotations

from plait.plan.shapes import fsdp_groups, rank_coords, stage_params, stages_of

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
GLOO_ALL_GATHER_NATIVE_MAX = 32 << 20  # plait.comm.algorithms.DEFAULT_TABLE (Gloo)
DDP_FIRST_BUCKET, DDP_BUCKET = 1 << 20, 25 << 20  # plait.ddp.buckets' defaults


def label(dims, axes: tuple[str, ...]) -> str:
    sizes = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
             "tp": dims.tp}
    return "+".join(a for a in AXES if a in axes and sizes[a] > 1)


def all_reduce(n: int, nbytes: int) -> int:
    return int(2 * (n - 1) / n * nbytes) if n > 1 else 0


def all_gather(n: int, piece: int, *, backend: str = "gloo") -> int:
    """An even all-gather of `piece` bytes per rank."""
    if n == 1:
        return 0
    if backend == "gloo" and n * piece > GLOO_ALL_GATHER_NATIVE_MAX:
        return all_reduce(n, n * piece)
    return (n - 1) * piece


def reduce_scatter(n: int, piece: int) -> int:
    return (n - 1) * piece if n > 1 else 0


def _checkpointed(layer: int, ac_mode: str, ac_every: int) -> bool:
    return ac_mode == "full" or (ac_mode == "every" and layer % ac_every == 0)


def bytes_per_step(args, dims, *, seq_len: int, batch_size: int, global_rank: int, ac_mode: str = "none",
                   ac_every: int = 2, backend: str = "gloo") -> dict[str, int]:
    """{axis label: bytes} this rank sends in a steady-state step (see the module docstring)."""
    return _walk(args, dims, seq_len=seq_len, batch_size=batch_size, global_rank=global_rank, ac_mode=ac_mode,
                 ac_every=ac_every, backend=backend)[0]


def calls_per_step(args, dims, *, seq_len: int, batch_size: int, global_rank: int, ac_mode: str = "none",
                   ac_every: int = 2, backend: str = "gloo") -> dict[str, int]:
    """{axis label: collective and point-to-point calls} this rank takes part in per step (the
    same walk as bytes_per_step; a call over a group of one is not one)."""
    return _walk(args, dims, seq_len=seq_len, batch_size=batch_size, global_rank=global_rank, ac_mode=ac_mode,
                 ac_every=ac_every, backend=backend)[1]


def _walk(args, dims, *, seq_len: int, batch_size: int, global_rank: int, ac_mode: str, ac_every: int,
          backend: str) -> tuple[dict[str, int], dict[str, int]]:
    out: dict[str, int] = {}
    calls: dict[str, int] = {}

    def add(axes: tuple[str, ...], nbytes: int, n_calls: int = 1) -> None:
        key = label(dims, axes)
        if key and n_calls:
            calls[key] = calls.get(key, 0) + int(n_calls)
        if nbytes:
            out[key] = out.get(key, 0) + int(nbytes)

    c = rank_coords(dims, global_rank)
    t, n, R, cp, f4 = dims.tp, dims.dp_shard * dims.cp, dims.dp_replicate, dims.cp, 4
    m = dims.microbatches if dims.pp > 1 else 1
    mb = batch_size // dims.dp // m
    d, s = args.dim, seq_len // cp  # s: the tokens of a sequence this rank holds
    sp = dims.sequence_parallel and t > 1
    for stage in stages_of(dims, c["pp"]):
        params = stage_params(args, dims, stage, c["tp"])
        first, last = stage == 0, stage == dims.num_stages - 1
        layers = dims.stage_layers[stage]
        # data parallel
        if n > 1:
            for group in fsdp_groups(params):
                piece = sum(p.fsdp_padded(n) for p in group) * f4
                gathers = 1 if dims.pp > 1 or group[0].block is None else 2
                add(("dp_shard", "cp"), gathers * all_gather(n, piece, backend=backend), gathers)
                add(("dp_shard", "cp"), reduce_scatter(n, piece))
                if R > 1:
                    add(("dp_replicate",), all_reduce(R, piece))
        elif R > 1:
            total = sum(p.numel for p in params) * f4
            if dims.pp > 1:
                add(("dp_replicate",), all_reduce(R, total))
            else:
                for bucket in _ddp_buckets([p.numel * f4 for p in reversed(params)]):
                    add(("dp_replicate",), all_reduce(R, bucket))
        # tensor (and sequence) parallel, per microbatch
        if t > 1:
            tok = mb * s
            if sp:
                x = (t - 1) * tok // t * d * f4
                per_block = 8 * x  # forward 2 AG + 2 RS, backward the same
                recompute = 3 * x  # 2 AG + 1 RS
            else:
                x = all_reduce(t, tok * d * f4)
                per_block, recompute = 4 * x, x
            mb_bytes = sum(per_block + (recompute if _checkpointed(i, ac_mode, ac_every) else 0) for i in layers)
            mb_bytes += (2 * x if sp else x) * (first + last)
            if last and dims.loss_parallel:
                mb_bytes += 3 * all_reduce(t, tok * f4)
            elif last:  # the logits gathered on the vocabulary dim
                mb_bytes += all_gather(t, tok * (args.vocab_size // t) * f4, backend=backend)
            mb_calls = sum((8 if sp else 4) + ((3 if sp else 1) if _checkpointed(i, ac_mode, ac_every) else 0)
                           for i in layers) + (2 if sp else 1) * (first + last)
            mb_calls += (3 if dims.loss_parallel else 1) if last else 0
            add(("tp",), m * mb_bytes, m * mb_calls)
            if sp:  # the SequenceParallel norms' Partial grads: once per step, or per microbatch
                norms = 2 * len(layers) + last  # where FSDP under a pipeline accumulates them
                times = m if n > 1 and dims.pp > 1 else 1
                add(("tp",), times * norms * all_reduce(t, d * f4), times * norms)
        ring = ring_bytes(args, dims, layers, seq_len=seq_len, batch_size=batch_size, ac_mode=ac_mode,
                          ac_every=ac_every, backend=backend)
        add(("cp",), ring, m * sum(3 + _checkpointed(i, ac_mode, ac_every) for i in layers) if cp > 1 else 0)
        # pipeline p2p, per microbatch
        if dims.pp > 1:
            act = mb * (s // t if sp else s) * d * f4
            add(("pp",), m * act * ((not last) + (not first)), 2 * m * ((not last) + (not first)))  # send + recv
    world = dims.world_size
    add(AXES, 2 * all_reduce(world, 8) + all_reduce(world, 4), 3)
    return out, calls


def ring_bytes(args, dims, layers, *, seq_len: int, batch_size: int, ac_mode: str = "none", ac_every: int = 2,
               backend: str = "gloo") -> int:
    """Ring attention's bytes per step on a cp rank for `layers` (plait train's rotation,
    "allgather"): per attention call and microbatch, K and V (repeated to the local heads, packed)
    all-gathered in forward, again in backward (and in a checkpointed block's recompute), and
    their fp32 grads reduce-scattered home."""
    cp, t = dims.cp, dims.tp
    if cp == 1:
        return 0
    m = dims.microbatches if dims.pp > 1 else 1
    mb = batch_size // dims.dp // m
    kv = 2 * mb * (args.n_heads // t) * (seq_len // cp) * args.head_dim * 4
    gathers = sum(2 + _checkpointed(i, ac_mode, ac_every) for i in layers)
    return m * (gathers * all_gather(cp, kv, backend=backend) + len(layers) * reduce_scatter(cp, kv))


def _ddp_buckets(sizes: list[int]) -> list[int]:
    """Bucket byte totals in reverse registration order (plait.ddp.buckets.assign_buckets)."""
    buckets, cur, k = [], 0, 0
    for b in sizes:
        cur += b
        if cur >= (DDP_FIRST_BUCKET if k == 0 else DDP_BUCKET):
            buckets.append(cur)
            cur, k = 0, k + 1
    return buckets + ([cur] if cur else [])


def bytes_per_rank(args, dims, **kw) -> list[dict[str, int]]:
    """`bytes_per_step` of every global rank."""
    return [bytes_per_step(args, dims, global_rank=r, **kw) for r in range(dims.world_size)]
