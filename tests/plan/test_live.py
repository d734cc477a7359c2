"""The planner's peak memory per rank against the peak live tensor bytes plait train counts
(--metrics.live_bytes: plait.train.live_bytes, every op's outputs and saved tensors by storage,
in the second step), the max over ranks against the fullest rank's prediction, on the tiny config.
"""

from __future__ import annotations

import tempfile

import pytest

from plait.plan.memory import memory_per_rank
from plait.testing import run_distributed
from plait.train.config import apply_overrides, load
from plait.train.layout import check
from tests.plan.test_measured import LAYOUTS

# over by more than 10% at this commit (predicted - measured, of measured): the memory model's
# DDP buckets, FSDP's unsharded groups and reduce-scatter buffers, and the checkpointed block's
# recompute are counted whole at the peak, where the live count finds them partly freed
OVER = {"single": "+11.9%", "fsdp2": "+22.6%", "fsdp2_ac": "+32.1%", "ddp2": "+26.3%", "tp2_sp_ac": "+32.5%",
        "tp2_nosp_ac": "+37.4%", "hsdp2x2_ac": "+41.6%", "fsdp2_tp2": "+22.7%", "fsdp2_pp2": "+18.6%",
        "ddp2_pp2": "+35.3%", "ddp2_tp2": "+15.2%", "tp2_ac_every": "+41.9%", "fsdp3_uneven": "+25.3%",
        "cp2": "+12.6%", "cp2_ac": "+18.0%", "cp2_tp2": "+14.2%", "hsdp2x2_tp2": "+32.6%"}
STEPS = ["--training.steps", "2", "--metrics.val_batches", "0", "--metrics.progress", "false",
         "--metrics.live_bytes", "true"]


def _peak(overrides: list[str]) -> int:
    from plait.train import train

    config = apply_overrides(load("tiny"), [*STEPS, "--job.dir", tempfile.mkdtemp(prefix="plait-plan-"), *overrides])
    return train(config).records[-1].peak_live_bytes


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=f"over {OVER[n]}"))
                                  if n in OVER else n for n in LAYOUTS])
def test_predicted_peak_within_10_percent_of_live_bytes(name):
    world, overrides = LAYOUTS[name]
    config = apply_overrides(load("tiny"), overrides)
    args, dims = check(config, world)
    t, ac = config.training, config.activation_checkpoint
    predicted = max(memory_per_rank(args, dims, seq_len=t.seq_len, batch_size=t.batch_size, global_rank=r,
                                    ac_mode=ac.mode, ac_every=ac.every).total for r in range(world))
    measured = run_distributed(_peak, overrides, world_size=world)
    assert len(set(measured)) == 1  # the trainer's all-reduce max
    print(f"{name}: predicted {predicted:,} measured {measured[0]:,} {(predicted - measured[0]) / measured[0]:+.1%}")
    assert abs(predicted - measured[0]) <= 0.10 * measured[0], (name, predicted, measured[0])
