"""plait's fully_shard against torch.distributed.fsdp.fully_shard (FSDP2).

    world 2 and 4 (Gloo, one thread per rank) -> the Llama "8m" config of
    plait.models.llama (8 blocks, dim 256, GQA 8/4 heads, SwiGLU 704, vocab 4096, untied:
    Ψ = 7,999,744 parameters), seq 128, batch 2 per rank, fully_shard per block then the
    root, AdamW
    -> per reshard_after_forward (True, False; the same for every group, root included):
       both on the same initial model, warmed up, then single steps alternately; a
       sample is the slowest rank's step, the ratio the median of adjacent steps' ratios
    -> counted, machine-independent (plait, CommDebugMode): bytes each rank sends per step
       over Ψ x 4 bytes, against 3(N-1)/N (reshard after forward: all-gather in forward
       and backward, reduce-scatter) or 2(N-1)/N; collectives per step
    -> resident bytes per rank of parameters + gradients + AdamW state (local shards,
       counted tensor by tensor), max over ranks, against the ZeRO-3 formula 16Ψ/N; the
       peak of unsharded flat buffers alive at once against root + the two largest
       other groups (the prefetch bound; without resharding after forward: every group)
    -> peak live tensor bytes during one step (plait.train.live_bytes: every tensor an op
       makes or autograd saves, plus params, grads, optimizer state and the unsharded
       buffers, each storage at its current size), plait and torch under the same count,
       against 16Ψ/N + the root's and the two largest other unsharded groups; the rest is
       activations and temporaries
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.common import alternating_times, human_bytes, max_over_ranks, median, print_table
from plait import comm
from plait.debug import CommDebugMode
from plait.fsdp import fully_shard
from plait.models.llama import CONFIGS, Transformer
from plait.testing import run_distributed
from plait.train.live_bytes import LiveBytes

BATCH_PER_RANK = 2
SEQ = 128
CONFIG = "8m"
WORLDS = (2, 4)


def _model(cfg) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(seed=0)
    return model


def _shard(model: Transformer, shard_fn, reshard: bool, **kwargs) -> Transformer:
    for block in model.layers.values():
        shard_fn(block, reshard_after_forward=reshard, **kwargs)
    shard_fn(model, reshard_after_forward=reshard, **kwargs)
    return model


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits (b, s, vocab) of tokens[:, :-1] against tokens[:, 1:]."""
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _forward(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[:, :-1])


def _step(model, opt, tokens: torch.Tensor) -> None:
    lm_loss(_forward(model, tokens), tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _resident(model, opt, group) -> int:
    """Bytes of this rank's parameter, gradient and optimizer-state tensors; max over ranks."""
    total = 0
    for p in model.parameters():
        total += _local(p).numel() * p.element_size()
        if p.grad is not None:
            total += _local(p.grad).numel() * p.grad.element_size()
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                total += _local(v).numel() * v.element_size()
    return int(max_over_ranks(total, group))


def _state_tensors(model, opt) -> list[torch.Tensor]:
    """Parameters, gradients and optimizer state: what a step starts with."""
    out = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    out += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _plait_buffers(model) -> list[torch.Tensor]:
    """plait's flat unsharded buffers (storage resized to 0 while sharded)."""
    return [s.group._flat for s in model._plait_fsdp_state.ctx.states
            if s.group is not None and s.group._flat is not None]


def _torch_buffers(model) -> list[torch.Tensor]:
    """torch FSDP2's unsharded parameters and all-gather outputs (storage freed while sharded)."""
    out = []
    for m in model.modules():
        get = getattr(m, "_get_fsdp_state", None)
        group = get()._fsdp_param_group if get is not None else None
        for fp in group.fsdp_params if group is not None else ():
            out += list(fp.all_gather_outputs) + ([fp._unsharded_param] if hasattr(fp, "_unsharded_param") else [])
    return out


def _measure(quick: bool) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    warnings.filterwarnings("ignore")
    group = comm.world_group()
    rank, n = comm.get_rank(group), comm.get_world_size(group)
    cfg = CONFIGS[CONFIG]
    rounds, warmup = (4, 2) if quick else (12, 3)
    tokens = torch.randint(cfg.vocab_size, (BATCH_PER_RANK * n, SEQ + 1), generator=torch.Generator().manual_seed(0))
    tokens = tokens[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
    psi = sum(p.numel() for p in _model(cfg).parameters())
    mesh = torch_mesh("cpu", (n,))
    out = []
    for reshard in (True, False):
        ours = _shard(_model(cfg), fully_shard, reshard)
        theirs = _shard(_model(cfg), torch_fully_shard, reshard, mesh=mesh)
        opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
        opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4)
        t_ours, t_theirs = alternating_times(partial(_step, ours, opt_ours, tokens),
                                             partial(_step, theirs, opt_theirs, tokens), group, warmup=warmup, rounds=rounds)
        live = []
        for model, opt, buffers in ((ours, opt_ours, _plait_buffers), (theirs, opt_theirs, _torch_buffers)):
            with LiveBytes(_state_tensors(model, opt) + buffers(model)) as counter:
                _step(model, opt, tokens)
            live.append(int(max_over_ranks(counter.peak, group)))
        ctx = ours._plait_fsdp_state.ctx
        ctx.peak_unsharded_bytes = 0
        with CommDebugMode() as mode:
            lm_loss(_forward(ours, tokens), tokens).backward()
        lm_loss(_forward(theirs, tokens), tokens).backward()
        resident = (_resident(ours, opt_ours, group), _resident(theirs, opt_theirs, group))
        opt_ours.step(), opt_theirs.step()
        opt_ours.zero_grad(), opt_theirs.zero_grad()
        groups = [s.group for s in ctx.states if s.group is not None]
        root, others = ours._plait_fsdp_state.group, sorted(g.unsharded_bytes for g in groups
                                                            if g is not ours._plait_fsdp_state.group)
        out.append(dict(
            reshard=reshard, n=n,
            ours=median([t[0] for t in t_ours]), theirs=median([t[0] for t in t_theirs]),
            ratio=median([a[0] / b[0] for a, b in zip(t_ours, t_theirs)]),
            cpu=median([a[1] / b[1] for a, b in zip(t_ours, t_theirs)]),
            counts=dict(mode.get_comm_counts()), sent=mode.get_total_bytes(),
            psi=psi, padded=sum(g.world * g.total for g in groups),
            resident=resident, peak=ctx.peak_unsharded_bytes, live=live,
            # resharding after forward: the root's buffer plus the current and the prefetched
            # group; without: every group stays unsharded from its forward to its backward
            peak_bound=root.unsharded_bytes + sum(others[-2:] if reshard else others),
        ))
        del ours, theirs, opt_ours, opt_theirs
    return out


def run(quick: bool) -> None:
    rows, mem_rows, live_rows = [], [], []
    for world in WORLDS:
        for r in run_distributed(_measure, quick, world_size=world, timeout=3600)[0]:
            n, psi_bytes = r["n"], r["psi"] * 4
            expected = (3 if r["reshard"] else 2) * (n - 1) / n
            counts = r["counts"]
            rows.append([
                n, r["reshard"], f"{r['ours'] * 1e3:.1f}", f"{r['theirs'] * 1e3:.1f}", f"{r['ratio']:.2f}",
                f"{r['cpu']:.2f}", f"{counts.get('all_gather', 0)} / {counts.get('reduce_scatter', 0)}",
                human_bytes(r["sent"]), f"{r['sent'] / psi_bytes:.4f}", f"{expected:.4f}",
                f"{r['sent'] / (r['padded'] * 4):.4f}",
            ])
            mem_rows.append([
                n, r["reshard"], human_bytes(r["resident"][0]), human_bytes(r["resident"][1]),
                human_bytes(16 * psi_bytes / 4 / n), f"{r['resident'][0] / (16 * r['psi'] / n):.4f}",
                human_bytes(r["peak"]), human_bytes(r["peak_bound"]),
            ])
            formula = 16 * r["psi"] / n + r["peak_bound"]
            live_rows.append([
                n, r["reshard"], human_bytes(r["live"][0]), human_bytes(r["live"][1]),
                f"{r['live'][0] / r['live'][1]:.2f}", human_bytes(formula),
                human_bytes(r["live"][0] - formula), f"{r['live'][0] / formula:.2f}",
            ])
    print_table(
        f"fully_shard step, Llama {CONFIG} (8 x d256, vocab 4096, Ψ 8.0M), seq {SEQ}, batch {BATCH_PER_RANK}/rank, "
        "per-block + root, AdamW, Gloo",
        ["ranks", "reshard_after_forward", "plait ms", "torch ms", "plait/torch", "CPU plait/torch",
         "all-gathers / reduce-scatters", "plait bytes/rank/step", "bytes / (Ψ·4)", "3(N-1)/N or 2(N-1)/N",
         "bytes / (padded Ψ·4)"],
        rows,
        notes="Step times: medians of alternating steps (slowest rank); plait/torch: median of adjacent "
              "steps' ratios; CPU: the same for the training thread's CPU time. Bytes: plait.comm's ring "
              "model, counted by CommDebugMode over forward + backward; padded Ψ counts each parameter's "
              "dim 0 rounded up to a multiple of N, what the collectives carry.",
    )
    print_table(
        "fully_shard memory per rank (max over ranks), fp32 AdamW",
        ["ranks", "reshard_after_forward", "plait params+grads+optim", "torch params+grads+optim", "16Ψ/N",
         "plait / (16Ψ/N)", "plait peak unsharded buffers", "bound"],
        mem_rows,
        notes="Resident: every local shard of parameters, gradients and AdamW state (exp_avg, exp_avg_sq, "
              "step), counted tensor by tensor after backward; the excess over 16Ψ/N is uneven chunks "
              "and AdamW's per-parameter step scalars. Peak bound: with resharding after forward, the root's "
              "buffer plus the two largest other groups (current + prefetched); without, every group.",
    )
    print_table(
        "fully_shard peak live tensor bytes during a step (max over ranks)",
        ["ranks", "reshard_after_forward", "plait peak", "torch peak", "plait/torch",
         "16Ψ/N + unsharded bound", "plait peak - formula", "plait / formula"],
        live_rows,
        notes="plait.train.live_bytes: every storage alive at once, at its current size, after each op of one "
              "forward + backward + AdamW step, counted the same way for plait and torch; formula: 16Ψ/N plus "
              "the root's and the two largest other groups' unsharded buffers (every group without resharding "
              "after forward). The excess is what the formula leaves out: activations saved for backward, "
              "temporaries (the (b, s, 4096) fp32 logits, their softmax and gradient: 4 MiB each at batch 2), "
              "and the collectives' own buffers (an all-gather's output before its copy into the flat buffer, "
              "the reduce-scatter input).",
    )
