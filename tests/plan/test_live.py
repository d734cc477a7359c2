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

# outside 10% at this commit (predicted - measured, of measured)
OVER = {"tp2_sp_ac": "+11.8%", "tp2_nosp_ac": "+10.9%", "fsdp2_tp2": "+10.2%", "fsdp2_cp2": "-10.1%"}
STEPS = ["--training.steps", "2", "--metrics.val_batches", "0", "--metrics.progress", "false",
         "--metrics.live_bytes", "true"]


def _peak(overrides: list[str]) -> int:
    from plait.train import train

    config = apply_overrides(load("tiny"), [*STEPS, "--job.dir", tempfile.mkdtemp(prefix="plait-plan-"), *overrides])
    return train(config).records[-1].peak_live_bytes


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=f"off by {OVER[n]}"))
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
