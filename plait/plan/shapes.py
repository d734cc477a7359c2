"""What one rank holds: its stages' parameters as plait's strategies shard them (torch-free).

    ModelArgs + ParallelDims + rank -> stages of this pp rank (the schedule's placement)
    -> per stage, its parameters' TP-local shapes (the Llama plan's styles: colwise weights
       Shard(0), rowwise Shard(1), embedding and output vocab rows Shard(0), norms Replicate)
    -> FSDP groups (one per block, one root group for what is left: embedding, final norm,
       output), each parameter padded as plait.fsdp pads it: ceil(rows / dp_shard) rows of
       its dp dim (dim 0, or dim 1 where TP shards dim 0), so a group's all-gather input is
       S = sum_i ceil(rows_i / n) * row_numel_i elements on every rank

Sizes follow torch.chunk (what DTensor's Shard and plait.fsdp use): piece r of `size`
split `n` ways is ceil(size/n) long, the last pieces shorter or empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


def chunk(size: int, n: int, rank: int) -> int:
    """Length of torch.chunk's piece `rank` of `size` elements split `n` ways."""
    step = -(-size // n)
    return max(0, min(step, size - rank * step))


@dataclass(frozen=True)
class Param:
    name: str
    local_shape: tuple[int, ...]  # TP-local (what FSDP shards over dp)
    tp_dim: int | None  # the dim tensor parallel shards, None: replicated over tp
    block: int | None  # layer index, None for the root group's (embedding, norm, output)

    @property
    def numel(self) -> int:
        n = 1
        for x in self.local_shape:
            n *= x
        return n

    def fsdp_padded(self, n: int) -> int:
        """Per-rank elements in the FSDP flat buffers: ceil(rows/n) rows of its dp dim."""
        dim = 0 if self.tp_dim != 0 else 1
        rows = self.local_shape[dim]
        row_numel = self.numel // rows if rows else 0
        return -(-rows // n) * row_numel

    def fsdp_local(self, n: int, rank: int) -> int:
        """Elements of this rank's real (unpadded) FSDP shard."""
        dim = 0 if self.tp_dim != 0 else 1
        rows = self.local_shape[dim]
        return chunk(rows, n, rank) * (self.numel // rows if rows else 0)


@lru_cache(maxsize=4096)
def stages_of(dims, pp_rank: int) -> tuple[int, ...]:
    """The pipeline stages pp rank `pp_rank` runs, as plait.train places them."""
    if dims.pp == 1:
        return [0]
    from plait.pipelining.schedules import build_schedule  # pure, torch-free

    plan = build_schedule(dims.pp_schedule, dims.pp, dims.microbatches,
                          stages_per_rank=dims.virtual_stages if dims.virtual_stages > 1 else None)
    return tuple(sorted(plan.stages_of(pp_rank)))


def stage_params(args, dims, stage: int, tp_rank: int) -> list[Param]:
    """The TP-local parameters of pipeline stage `stage` on tp rank `tp_rank`."""
    t, d, hd = dims.tp, args.dim, args.head_dim
    f = args.ffn_hidden_dim()

    def col(out: int) -> tuple[int, int]:  # ColwiseParallel: weight (out, in) Shard(0)
        return (chunk(out, t, tp_rank), d)

    def row(inp: int) -> tuple[int, int]:  # RowwiseParallel: weight (out, in) Shard(1)
        return (d, chunk(inp, t, tp_rank))

    tp0, tp1 = (0, 1) if t > 1 else (None, None)
    out: list[Param] = []
    first, last = stage == 0, stage == dims.num_stages - 1
    if first:
        out.append(Param("tok_embeddings.weight", col(args.vocab_size), tp0, None))
    for i in dims.stage_layers[stage]:
        p = f"layers.{i}."
        out += [Param(p + "attention.wq.weight", col(args.n_heads * hd), tp0, i),
                Param(p + "attention.wk.weight", col(args.kv_heads * hd), tp0, i),
                Param(p + "attention.wv.weight", col(args.kv_heads * hd), tp0, i),
                Param(p + "attention.wo.weight", row(args.n_heads * hd), tp1, i),
                Param(p + "feed_forward.w1.weight", col(f), tp0, i),
                Param(p + "feed_forward.w2.weight", row(f), tp1, i),
                Param(p + "feed_forward.w3.weight", col(f), tp0, i),
                Param(p + "attention_norm.weight", (d,), None, i),
                Param(p + "ffn_norm.weight", (d,), None, i)]
    if last:
        out.append(Param("norm.weight", (d,), None, None))
        if not (args.tie_embeddings and first):
            out.append(Param("output.weight", col(args.vocab_size), tp0, None))
    return out


def fsdp_groups(params: list[Param]) -> list[list[Param]]:
    """fully_shard(block) per block, then the root: blocks in layer order, the root group last
    (empty groups dropped: a middle pipeline stage's root owns no parameter of its own)."""
    blocks: dict[int, list[Param]] = {}
    root: list[Param] = []
    for p in params:
        (root if p.block is None else blocks.setdefault(p.block, [])).append(p)
    groups = [blocks[i] for i in sorted(blocks)]
    return groups + ([root] if root else [])


def rank_coords(dims, global_rank: int) -> dict[str, int]:
    """(pp, dp_replicate, dp_shard, cp, tp) coordinates of a global rank (row-major, tp fastest),
    with "fsdp": the rank's index on the flattened ("dp_shard", "cp") axis FSDP shards over."""
    out, r = {}, global_rank
    for name, n in (("tp", dims.tp), ("cp", dims.cp), ("dp_shard", dims.dp_shard),
                    ("dp_replicate", dims.dp_replicate), ("pp", dims.pp)):
        out[name] = r % n
        r //= n
    out["fsdp"] = out["dp_shard"] * dims.cp + out["cp"]
    return out
