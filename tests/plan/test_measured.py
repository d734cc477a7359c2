"""The planner against plait train's own counts: predicted bytes per rank per step equal the
bytes plait.comm's door counted (CommDebugMode, by mesh axis), on the tiny config.

Each layout trains 3 steps on the pool's ranks (no validation) and the third step is compared:
the first sends pipeline shape metadata and the second DDP's bucket rebuild, which the planner
leaves out (it predicts the steady state). Equality is exact: the counts are integers.
"""

from __future__ import annotations

import tempfile

import pytest

from plait.plan.traffic import bytes_per_step
from plait.testing import run_distributed
from plait.train.config import apply_overrides, load
from plait.train.layout import check

STEPS = ["--training.steps", "3", "--metrics.val_batches", "0", "--metrics.progress", "false"]


def _measure(overrides: list[str]) -> dict:
    from plait.train import train

    config = apply_overrides(load("tiny"), [*STEPS, "--job.dir", tempfile.mkdtemp(prefix="plait-plan-"),
                                            *overrides])
    result = train(config)
    return {"bytes": result.bytes_sent_by_axis[-1]}


LAYOUTS = {
    "single": (1, []),
    "fsdp2": (2, ["--parallel.dp_shard", "2"]),
    "fsdp2_ac": (2, ["--parallel.dp_shard", "2", "--activation_checkpoint.mode", "full"]),
    "ddp2": (2, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1"]),
    "tp2_sp": (2, ["--parallel.dp_shard", "1", "--parallel.tp", "2"]),
    "tp2_sp_ac": (2, ["--parallel.dp_shard", "1", "--parallel.tp", "2", "--activation_checkpoint.mode", "full"]),
    "tp2_nosp_ac": (2, ["--parallel.dp_shard", "1", "--parallel.tp", "2", "--parallel.sequence_parallel", "false",
                        "--activation_checkpoint.mode", "full"]),
    "pp2_1f1b": (2, ["--parallel.dp_shard", "1", "--parallel.pp", "2"]),
    "pp2_interleaved": (2, ["--parallel.dp_shard", "1", "--parallel.pp", "2", "--parallel.pp_schedule",
                            "Interleaved1F1B", "--parallel.virtual_stages", "2", "--model.n_layers", "4"]),
    "hsdp2x2_ac": (4, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2",
                       "--activation_checkpoint.mode", "full"]),
    "fsdp2_tp2": (4, ["--parallel.dp_shard", "2", "--parallel.tp", "2"]),
    "fsdp2_pp2": (4, ["--parallel.dp_shard", "2", "--parallel.pp", "2"]),
    "tp2_pp2": (4, ["--parallel.dp_shard", "1", "--parallel.tp", "2", "--parallel.pp", "2"]),
    "ddp2_pp2": (4, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1", "--parallel.pp", "2"]),
    "ddp2_tp2": (4, ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1", "--parallel.tp", "2"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_predicted_bytes_equal_counted(name):
    world, overrides = LAYOUTS[name]
    config = apply_overrides(load("tiny"), overrides)
    args, dims = check(config, world)
    ac = config.activation_checkpoint
    measured = run_distributed(_measure, overrides, world_size=world)
    for rank, got in enumerate(measured):
        predicted = bytes_per_step(args, dims, seq_len=config.training.seq_len,
                                   batch_size=config.training.batch_size, global_rank=rank,
                                   ac_mode=ac.mode, ac_every=ac.every)
        assert predicted == got["bytes"], f"rank {rank}: predicted {predicted} != counted {got['bytes']}"
