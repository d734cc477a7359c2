"""plait's FullyShardedDataParallel against torch.distributed.fsdp.FullyShardedDataParallel
(FSDP1), both with the transformer auto-wrap policy.

    world 2 (Gloo, one thread per rank) -> the Llama "8m" config (Ψ = 7,999,744 parameters),
    seq 128, batch 2 per rank, FSDP(model, auto_wrap_policy=transformer_auto_wrap_policy
    {TransformerBlock}, sharding_strategy=S, device_id=cpu), AdamW
    -> per S in FULL_SHARD, SHARD_GRAD_OP: both from the same initial model, warmed up, then
       single steps alternately; a sample is the slowest rank's step, the ratio the median
       of adjacent steps' ratios (wall and training-thread CPU)
    -> counted (plait, CommDebugMode): bytes each rank sends per step over Ψ x 4 bytes,
       against 3(N-1)/N (FULL_SHARD: all-gather in forward and backward, reduce-scatter) or
       2(N-1)/N (SHARD_GRAD_OP); FULL_SHARD's root keeps its parameters from forward to
       backward (torch's rule too), so it sends a little under 3(N-1)/N
    -> FULL_STATE_DICT (rank0_only) save: the slowest rank's time, plait/torch
"""

from __future__ import annotations

import time
import warnings
from functools import partial

import torch

from benchmarks.bench_fsdp import BATCH_PER_RANK, CONFIG, SEQ, _model, _step, lm_loss
from benchmarks.common import alternating_times, human_bytes, max_over_ranks, median, print_table
from plait import comm
from plait.debug import CommDebugMode
from plait.models.llama import CONFIGS, TransformerBlock
from plait.testing import run_distributed

WORLD = 2


def _wrap(lib, strategy_name: str):
    policy = partial(lib.wrap.transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
    model = _model(CONFIGS[CONFIG])
    return lib.FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                                        sharding_strategy=getattr(lib.ShardingStrategy, strategy_name))


def _save_time(lib, model, group) -> float:
    config = lib.FullStateDictConfig(offload_to_cpu=False, rank0_only=True)  # offload: torch fails on CPU
    comm.barrier(group=group)
    t0 = time.perf_counter()
    with lib.FullyShardedDataParallel.state_dict_type(model, lib.StateDictType.FULL_STATE_DICT, config):
        model.state_dict()
    return max_over_ranks(time.perf_counter() - t0, group)


def _measure(quick: bool) -> list[dict]:
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.fsdp.wrap  # noqa: F401 - lib.wrap below

    import plait.fsdp as plait_fsdp
    import plait.fsdp.wrap  # noqa: F401

    warnings.filterwarnings("ignore")
    group = comm.world_group()
    rank, n = comm.get_rank(group), comm.get_world_size(group)
    cfg = CONFIGS[CONFIG]
    rounds, warmup, saves = (4, 2, 2) if quick else (12, 3, 5)
    tokens = torch.randint(cfg.vocab_size, (BATCH_PER_RANK * n, SEQ + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
    psi = sum(p.numel() for p in _model(cfg).parameters())
    out = []
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        ours, theirs = _wrap(plait_fsdp, strategy), _wrap(torch_fsdp, strategy)
        opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
        opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
        t_ours, t_theirs = alternating_times(partial(_step, ours, opt_ours, tokens),
                                             partial(_step, theirs, opt_theirs, tokens), group,
                                             warmup=warmup, rounds=rounds)
        with CommDebugMode() as mode:
            lm_loss(ours(tokens[:, :-1]), tokens).backward()
        opt_ours.zero_grad()
        save = [(_save_time(plait_fsdp, ours, group), _save_time(torch_fsdp, theirs, group)) for _ in range(saves)]
        out.append(dict(
            strategy=strategy, n=n, psi=psi,
            ours=median([t[0] for t in t_ours]), theirs=median([t[0] for t in t_theirs]),
            ratio=median([a[0] / b[0] for a, b in zip(t_ours, t_theirs)]),
            cpu=median([a[1] / b[1] for a, b in zip(t_ours, t_theirs)]),
            counts=dict(mode.get_comm_counts()), sent=mode.get_total_bytes(),
            save_ours=median([s[0] for s in save]), save_ratio=median([a / b for a, b in save]),
        ))
        del ours, theirs, opt_ours, opt_theirs
    return out


def run(quick: bool) -> None:
    rows = []
    for r in run_distributed(_measure, quick, world_size=WORLD, timeout=3600)[0]:
        n, psi_bytes = r["n"], r["psi"] * 4
        expected = (3 if r["strategy"] == "FULL_SHARD" else 2) * (n - 1) / n
        counts = r["counts"]
        rows.append([
            n, r["strategy"], f"{r['ours'] * 1e3:.1f}", f"{r['theirs'] * 1e3:.1f}", f"{r['ratio']:.2f}",
            f"{r['cpu']:.2f}", f"{counts.get('all_gather', 0)} / {counts.get('reduce_scatter', 0)}",
            human_bytes(r["sent"]), f"{r['sent'] / psi_bytes:.4f}", f"{expected:.4f}",
            f"{r['save_ours'] * 1e3:.1f}", f"{r['save_ratio']:.2f}",
        ])
    print_table(
        f"FullyShardedDataParallel step, Llama {CONFIG} (Ψ 8.0M), seq {SEQ}, batch {BATCH_PER_RANK}/rank, "
        "transformer_auto_wrap_policy, AdamW, Gloo",
        ["ranks", "sharding_strategy", "plait ms", "torch ms", "plait/torch", "CPU plait/torch",
         "all-gathers / reduce-scatters", "plait bytes/rank/step", "bytes / (Ψ·4)", "3(N-1)/N or 2(N-1)/N",
         "FULL_STATE_DICT save ms", "save plait/torch"],
        rows,
        notes="Step times: medians of alternating steps (slowest rank); plait/torch: median of adjacent steps' "
              "ratios; CPU: the same for the training thread's CPU time. Bytes: plait.comm's ring model over "
              "forward + backward (FULL_SHARD's root is not re-gathered in backward, as in torch). Save: "
              "model.state_dict() under FULL_STATE_DICT, rank0_only, slowest rank, median of alternating runs.",
    )
