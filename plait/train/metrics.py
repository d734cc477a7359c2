"""Per-step figures: loss, throughput, MFU, peak memory; a JSONL log and the closing summary.

    step -> StepRecord (global figures, agreed by one all-reduce before) -> JSONL line
         -> progress bar (rank 0)     end -> summary table (rank 0)

FLOPs per token (torchtitan's estimate, forward + backward): 6 * N + 12 * L * H * Q * T, N the
parameters without the embedding table, L layers, H heads, Q head_dim, T the sequence length
(the attention scores, which N does not count). MFU = achieved FLOPs/s per rank / peak FLOPs/s
per rank; the peak is `metrics.peak_flops`, or, unset: 989e12 (an H100's bf16 dense) on CUDA
and 1e12 on a CPU, an assumed round figure for a few cores' fp32 FMA throughput — the CPU MFU
compares runs with each other, not with hardware.

Peak memory per rank: CUDA, torch.cuda.max_memory_allocated(); CPU, the process's peak
resident set size (getrusage ru_maxrss) — everything the process touched, Python and torch
included, not only tensors.
"""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from plait.models.llama import ModelArgs

if TYPE_CHECKING:  # the trainer's types; it imports this module
    from plait.train.config import JobConfig
    from plait.train.layout import ParallelDims

CPU_PEAK_FLOPS = 1e12
CUDA_PEAK_FLOPS = 989e12


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    n = args.num_params() - args.vocab_size * args.dim  # without the embedding table
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def peak_flops(configured: float, device_type: str) -> float:
    if configured > 0:
        return configured
    return CUDA_PEAK_FLOPS if device_type == "cuda" else CPU_PEAK_FLOPS


def peak_memory_bytes(device_type: str) -> int:
    if device_type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(kb if sys.platform == "darwin" else kb * 1024)


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens_per_s: float  # global
    tokens_per_s_per_rank: float
    mfu: float  # fraction of the peak per rank
    step_time_s: float
    step_cpu_s: float  # CPU seconds of the step, summed over ranks and their threads (process_time)
    peak_memory_mib: float  # max over ranks
    val_loss: float | None = None
    bytes_sent_by_axis: dict[str, int] | None = None  # rank 0's this step (what plait.plan predicts)
    peak_live_bytes: int | None = None  # max over ranks of the peak live tensor bytes (metrics.live_bytes)


class MetricsLogger:
    """Writes one JSON object per line (rank 0 only); keeps the records for the summary."""

    def __init__(self, path: str | Path | None, *, is_rank0: bool, progress_total: int = 0,
                 progress: bool = True, initial: int = 0) -> None:
        self.records: list[StepRecord] = []
        self.is_rank0 = is_rank0
        self._file = None
        if is_rank0 and path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a")  # noqa: SIM115 - closed in close()
        self._bar = None
        if is_rank0 and progress:
            from tqdm import tqdm

            self._bar = tqdm(total=progress_total, initial=initial, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr)

    def write(self, kind: str, **fields: object) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, **fields}) + "\n")
            self._file.flush()

    def log(self, record: StepRecord) -> None:
        self.records.append(record)
        self.write("step", **asdict(record))
        if self._bar is not None:
            post = {"loss": f"{record.loss:.3f}", "tok/s": f"{record.tokens_per_s:.0f}"}
            if record.val_loss is not None:
                post["val"] = f"{record.val_loss:.3f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()


AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the world mesh's, outermost first


def axis_label(group_ranks: tuple[int, ...] | list[int], dims) -> str:
    """The mesh axes a group spans, "+"-joined ("tp", "dp_replicate+dp_shard", ...): those along
    which its global ranks' (pp, dp_replicate, dp_shard, cp, tp) coordinates differ. "" for one rank."""
    sizes = (dims.pp, dims.dp_replicate, dims.dp_shard, getattr(dims, "cp", 1), dims.tp)

    def coords(r: int) -> tuple[int, ...]:
        out = []
        for n in reversed(sizes):  # row-major: tp fastest
            out.append(r % n)
            r //= n
        return tuple(reversed(out))

    cs = [coords(r) for r in group_ranks]
    return "+".join(a for i, a in enumerate(AXES) if len({c[i] for c in cs}) > 1)


def bytes_by_axis(events, dims) -> dict[str, int]:
    """This rank's bytes sent, summed per axis label, from plait.comm events (sends only: a
    recv sends nothing; a group of one sends nothing and is left out)."""
    out: dict[str, int] = {}
    for e in events:
        if e.bytes_sent:
            label = axis_label(e.group_ranks, dims)
            out[label] = out.get(label, 0) + int(e.bytes_sent)
    return out


def summary_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 2 + max(len(v) for _, v in rows))
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])


def summary(config: JobConfig, dims: ParallelDims, args: ModelArgs, recs: list[StepRecord],
            val_losses: dict[int, float], graph_breaks: int, wall: float, device_type: str) -> str:
    """The table plait train prints at the end (rank 0): layout, model, loss, throughput,
    memory, bytes; from the step records."""
    if not recs:
        return "no steps run (already at training.steps)"
    timed = recs[1:] or recs  # the first step includes warm-up (compile, first gathers)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    rows = [
        ("layout", dims.describe()),
        ("model", f"{config.model.name}: {args.num_params():,} parameters, {args.n_layers} layers, "
                  f"vocab {args.vocab_size}"),
        ("steps", f"{recs[0].step}..{recs[-1].step} ({len(recs)} run, {wall:.1f} s)"),
        ("loss", f"{recs[0].loss:.4f} -> {recs[-1].loss:.4f}"),
    ]
    if val_losses:
        first, last = min(val_losses), max(val_losses)
        rows.append(("val loss", f"{val_losses[first]:.4f} (step {first}) -> "
                                 f"{val_losses[last]:.4f} (step {last})"))
    rows += [
        ("tokens/s", f"{mean([r.tokens_per_s for r in timed]):.0f} global, "
                     f"{mean([r.tokens_per_s_per_rank for r in timed]):.0f} per rank"),
        ("MFU", f"{100 * mean([r.mfu for r in timed]):.3f}% of {peak_flops(config.metrics.peak_flops, device_type):.3g} "
                "FLOP/s per rank (metrics.peak_flops)"),
        ("peak memory", f"{max(r.peak_memory_mib for r in recs):.0f} MiB per rank (max; CPU: peak RSS)"),
    ]
    live = [r.peak_live_bytes for r in recs if r.peak_live_bytes is not None]
    if live:
        rows.append(("peak live tensors", f"{max(live) / 2**20:.2f} MiB per rank (max; one step, "
                                          "metrics.live_bytes)"))
    rows += [
        ("bytes sent", ", ".join(f"{k or 'none'} {v:,}" for k, v in (recs[-1].bytes_sent_by_axis or {}).items())
         + " per step (this rank's last; plait plan --compare predicts them)"),
    ]
    if config.compile.enabled:
        rows.append(("graph breaks", str(graph_breaks)))
    return summary_table(rows)
