"""Parity: `plait train` on an N-D layout equals one process on the same config and data.

The tiny config (2 layers, 8 heads / 4 KV heads, byte vocabulary 256, global batch 8 of 32
tokens, AdamW lr 3e-3 with warm-up and cosine decay, grad clipping at 1.0) for 10 steps; each
layout's global-mean loss every step against a 1-rank run, and the held-out loss at steps 5
and 10. The global batch is the same 8 windows per step on every layout (the data stream is
global; dp ranks take strided slices), so only the order of float32 sums differs: sharded
matmuls (TP), per-microbatch means (PP), reduce-scatter averaging (FSDP). The global grad
norm (which clipping uses) is compared too: it caught SequenceParallel norms' Partial grads
counted as if complete. Tolerance rtol 1e-5 / atol 1e-5 on losses near 5 and norms near 1-2:
measured at most 1.4e-6 on every layout here (AdamW normalises each update, so rounding of
one step carries into the next instead of washing out): a margin of ~7x.
"""

from __future__ import annotations

import pytest
import torch

from plait.testing import run_distributed
from tests.train.common import run_tiny

TOL = dict(rtol=1e-5, atol=1e-5)
_reference: dict[tuple[str, ...], dict] = {}


def reference(base: tuple[str, ...] = ()) -> dict:
    """The 1-rank run of the tiny config with `base` overrides (cached per `base`)."""
    if base not in _reference:
        _reference[base] = run_distributed(run_tiny, list(base), world_size=1)[0]
    return _reference[base]


def check(world: int, overrides: list[str], *, base: tuple[str, ...] = (), val_steps: tuple[int, ...] = (5, 10),
          learns: float = 0.5) -> list[dict]:
    """`overrides` on `world` ranks against the 1-rank run, both on the tiny config + `base`;
    held-out losses at `val_steps`; the reference's loss must drop by `learns` over the run."""
    ref = reference(base)
    results = run_distributed(run_tiny, [*base, *overrides], world_size=world)
    for rank, got in enumerate(results):  # every rank reports the same global figures
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL,
                                   msg=lambda m, r=rank: f"rank {r} losses: {m}")
        torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), **TOL,
                                   msg=lambda m, r=rank: f"rank {r} grad norms: {m}")
        assert sorted(got["val"]) == sorted(ref["val"]) == list(val_steps)
        for step in ref["val"]:
            torch.testing.assert_close(got["val"][step], ref["val"][step], **TOL)
    assert ref["losses"][-1] < ref["losses"][0] - learns  # it learns: the comparison is not of noise
    return results


def test_3d_dp_shard_x_tp_x_pp_on_8_ranks():
    check(8, ["--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.pp", "2"])


def test_hsdp_x_tp_on_8_ranks():
    """dp_replicate(2) x dp_shard(2) x tp(2): fully_shard on the (dp_replicate, dp_shard) slice
    of the 4-D root over TP parameters (torch's (Replicate(), _StridedShard(0, sf=2), Shard(0)))."""
    check(8, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--parallel.tp", "2"])


@pytest.mark.parametrize("layout", [
    ["--parallel.dp_shard", "2", "--parallel.tp", "2"],                          # FSDP x TP (+SP, loss parallel)
    ["--parallel.dp_shard", "2", "--parallel.pp", "2"],                          # FSDP x PP (1F1B)
    ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.dp_shard", "1"],    # TP x PP
    ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2",                 # HSDP, and
     "--activation_checkpoint.mode", "full"],                                    # every block recomputed
    ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",                 # DDP (replicate) x TP
     "--parallel.tp", "2"],
    ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",                 # DDP x PP (one reduce
     "--parallel.pp", "2"],                                                      # per stage per step)
], ids=["fsdp_x_tp", "fsdp_x_pp", "tp_x_pp", "hsdp_ac", "ddp_x_tp", "ddp_x_pp"])
def test_2d_layouts_on_4_ranks(layout):
    check(4, layout)


def test_pure_data_parallel_runs_as_replicate_on_3_ranks():
    """dp_replicate alone is plait.ddp.replicate over mesh["dp_replicate"] (whole grads all-reduced),
    not fully_shard on an (R, 1) mesh; world size 3 (the tiny batch 8 does not split 3 ways, so 6)."""
    results = run_distributed(_ddp_parts_and_losses, world_size=3)
    for got in results:
        assert got["replicated"] and not got["sharded"]
    ref = run_distributed(run_tiny, ["--training.batch_size", "6"], world_size=1)[0]
    for got in results:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL)
        torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), **TOL)


def _ddp_parts_and_losses() -> dict:
    from plait.ddp.replicate import replicate_state
    from plait.tensor import DTensor
    from plait.train import apply_overrides, load
    from plait.train.layout import build_meshes
    from plait.train.parallelize import build_parts
    from plait.train.trainer import check, lm_loss

    overrides = ["--parallel.dp_replicate", "3", "--parallel.dp_shard", "1", "--training.batch_size", "6"]
    config = apply_overrides(load("tiny"), overrides)
    args, dims = check(config, 3)
    from plait.models.llama import Transformer

    model = Transformer(args)
    parts = build_parts(model, dims, build_meshes(dims), loss_fn=lm_loss, ac_mode="none", ac_every=1,
                        compile=False)
    (module,) = parts.modules
    replicate_state(module)  # raises if not replicated
    sharded = any(isinstance(p, DTensor) for p in module.parameters())
    got = run_tiny(overrides)
    return {**got, "replicated": True, "sharded": sharded}
