"""plait's DistributedDataParallel against torch.nn.parallel.DistributedDataParallel.

    2 ranks (Gloo, one thread each) -> the GPT of benchmarks.models (4 layers, d_model 256,
    vocab 1024, seq 128, tied embeddings), batch 8 per rank, AdamW
    -> per bucket cap: both wrappers on the same initial model, warmed up (buckets rebuilt),
       then single steps alternately; a sample is the slowest rank's step time, the ratio
       the median over rounds of plait's step / torch's adjacent step
    -> counted, machine-independent: all-reduces per step and bytes each rank sends per
       step (plait: CommDebugMode; torch: its reducer's buckets under the same ring
       model), against the lower bound 2(N-1)/N x gradient bytes
    -> comm hooks: bytes per step with bf16/fp16 and PowerSGD against plain, next to the
       expected 0.5 and sum(r(n+m) or n*m) / sum(n*m)
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from benchmarks.common import alternating_times, human_bytes, median, print_table
from benchmarks.models import GPT, GPTConfig, lm_loss, random_tokens
from plait import comm
from plait.ddp import DistributedDataParallel
from plait.ddp.comm_hooks import default_hooks, powerSGD_hook
from plait.debug import CommDebugMode
from plait.testing import run_distributed

BATCH_PER_RANK = 8
WORLD = 2
CAPS = (1, 25, None)  # None: torch's default, a 1 MiB first bucket then 25 MiB


def _model(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def _step(ddp, opt, tokens: torch.Tensor) -> None:
    lm_loss(ddp(tokens), tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _plait_counts(ddp, opt, tokens: torch.Tensor) -> tuple[int, int]:
    with CommDebugMode() as mode:
        _step(ddp, opt, tokens)
    return mode.get_comm_counts()["all_reduce"], mode.get_comm_bytes()["all_reduce"]


def _powersgd_expected(model: torch.nn.Module, rank: int) -> float:
    """Numbers PowerSGD sends over numbers plain sends (min_compression_rate 2)."""
    before = after = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank)
        before += n * m
        after += r * (n + m) if 2 * r * (n + m) < n * m else n * m
    return after / before


def _measure(quick: bool) -> dict:
    warnings.filterwarnings("ignore", category=FutureWarning)
    group = comm.world_group()
    rank, n = comm.get_rank(group), comm.get_world_size(group)
    cfg = GPTConfig.small()
    rounds, warmup = (4, 2) if quick else (16, 3)
    tokens = random_tokens(cfg, BATCH_PER_RANK * n, seed=0)[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
    grad_bytes = sum(p.numel() * p.element_size() for p in _model(cfg).parameters())
    ring = 2 * (n - 1) / n
    out: dict = {"grad_bytes": grad_bytes, "bound": ring * grad_bytes, "caps": [], "hooks": []}

    for cap in CAPS:
        ours, theirs = DistributedDataParallel(_model(cfg), bucket_cap_mb=cap), TorchDDP(_model(cfg), bucket_cap_mb=cap)
        opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
        opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
        t_ours, t_theirs = alternating_times(partial(_step, ours, opt_ours, tokens),
                                             partial(_step, theirs, opt_theirs, tokens), group, warmup=warmup, rounds=rounds)
        calls, sent = _plait_counts(ours, opt_ours, tokens)
        torch_buckets = theirs.reducer._get_zeros_like_grad_buckets()
        torch_bytes = sum(int(ring * b.buffer().numel() * b.buffer().element_size()) for b in torch_buckets)
        paired = median([a[0] / b[0] for a, b in zip(t_ours, t_theirs)])  # adjacent steps: drift cancels
        cpu = median([a[1] / b[1] for a, b in zip(t_ours, t_theirs)])
        out["caps"].append(dict(cap=cap, ours=median([t[0] for t in t_ours]), theirs=median([t[0] for t in t_theirs]),
                                ratio=paired, cpu=cpu,
                                calls=calls, sent=sent,
                                buckets=len(ours.reducer.buckets), torch_buckets=len(torch_buckets),
                                torch_bytes=torch_bytes))
        del ours, theirs, opt_ours, opt_theirs

    hooks = [
        ("plain all-reduce", None, None, 1.0),
        ("bf16_compress_hook", default_hooks.bf16_compress_hook, None, 0.5),
        ("fp16_compress_hook", default_hooks.fp16_compress_hook, None, 0.5),
    ]
    for r in (1, 4):
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2)
        hooks.append((f"powerSGD_hook rank {r}", powerSGD_hook.powerSGD_hook, state,
                      _powersgd_expected(_model(cfg), r)))
    for name, hook, state, expected in hooks:
        ddp = DistributedDataParallel(_model(cfg))
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        for _ in range(warmup):  # past start_powerSGD_iter
            _step(ddp, opt, tokens)
        calls, sent = _plait_counts(ddp, opt, tokens)
        out["hooks"].append(dict(name=name, calls=calls, sent=sent, expected=expected))
    return out


def run(quick: bool) -> None:
    r = run_distributed(_measure, quick, world_size=WORLD, timeout=3600)[0]
    bound = r["bound"]
    rows = []
    for c in r["caps"]:
        rows.append([
            "default (1 MiB, then 25)" if c["cap"] is None else c["cap"],
            f"{c['ours'] * 1e3:.1f}", f"{c['theirs'] * 1e3:.1f}", f"{c['ratio']:.2f}", f"{c['cpu']:.2f}",
            f"{c['buckets']} / {c['torch_buckets']}", c["calls"],
            human_bytes(c["sent"]), human_bytes(c["torch_bytes"]), f"{c['sent'] / bound:.3f}",
        ])
    print_table(
        f"DDP step, GPT {human_bytes(r['grad_bytes'])} of gradients, batch {BATCH_PER_RANK}/rank, AdamW, "
        f"{WORLD} ranks Gloo",
        ["bucket_cap_mb", "plait ms", "torch ms", "plait/torch", "CPU plait/torch", "buckets plait/torch",
         "all-reduces/step",
         "plait bytes/rank/step", "torch bytes/rank/step", "plait/bound"],
        rows,
        notes=f"Step times: medians of alternating steps (slowest rank); plait/torch: median of the "
              f"ratios of adjacent steps, which cancels drift in a shared machine's load; CPU: the same "
              f"for the training thread's CPU time (the wrapper's own cost, insensitive to load). Lower bound 2(N-1)/N x gradient bytes = "
              f"{human_bytes(bound)} per rank per step; torch's bytes are its buckets under the same ring model.",
    )
    plain = r["hooks"][0]["sent"]
    print_table(
        "DDP comm hooks: bytes each rank sends per step (plait)",
        ["hook", "all-reduces/step", "bytes/rank/step", "vs plain", "expected"],
        [[h["name"], h["calls"], human_bytes(h["sent"]), f"{h['sent'] / plain:.4f}", f"{h['expected']:.4f}"]
         for h in r["hooks"]],
        notes="PowerSGD expected: sum over parameters of r(n+m) if compressed (min_compression_rate 2) else "
              "n*m, over sum n*m; measured after start_powerSGD_iter.",
    )
