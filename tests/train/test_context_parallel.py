"""`plait train --parallel.cp N` equals one process on the same config and data.

The tiny config (seq_len 32: 2*cp chunks of 8 tokens for cp 2) for 10 steps, losses every
step, grad norms and held-out losses against a 1-rank run, with test_parity's tolerance
(rtol 1e-5 / atol 1e-5): the ring merges the softmax over blocks in another order and FSDP
averages the cp ranks' gradients over the flattened (dp_shard, cp) axis, both float32
rounding only. A rank computing attention over its own chunks alone (no ring) or a rotary
table not sharded like the tokens would change the loss in the first step.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from plait.testing import run_distributed
from tests.train.common import run_tiny
from tests.train.test_parity import TOL, check, reference


@pytest.mark.parametrize(("world", "layout"), [
    (2, ["--parallel.cp", "2", "--parallel.dp_shard", "1"]),
    (2, ["--parallel.cp", "2", "--parallel.dp_shard", "1", "--activation_checkpoint.mode", "full"]),
    (4, ["--parallel.cp", "2", "--parallel.dp_shard", "2"]),
    (4, ["--parallel.cp", "4", "--parallel.dp_shard", "1"]),
    (8, ["--parallel.cp", "2", "--parallel.dp_shard", "2", "--parallel.tp", "2"]),  # + SP, loss parallel
    (4, ["--parallel.cp", "2", "--parallel.pp", "2", "--parallel.dp_shard", "1"]),  # 1F1B on s/cp activations
], ids=["cp2", "cp2_ac", "cp2_x_dp_shard2", "cp4", "cp2_x_dp_shard2_x_tp2", "cp2_x_pp2"])
def test_context_parallel_train_matches_one_process(world, layout):
    check(world, layout)


def test_save_with_cp2_resume_without_cp_on_another_layout():
    """Saved at step 5 by cp 2 x dp_shard 2 (FSDP over the 4 ranks of dp_shard_cp), resumed by
    dp_shard 2 alone: the FSDP shards are resharded 4 -> 2 and steps 6..10 equal one process."""
    ref = reference()
    job = tempfile.mkdtemp(prefix="plait-cp-resume-")
    ckpt = ["--checkpoint.enabled", "true", "--checkpoint.interval", "5"]
    try:
        run_distributed(run_tiny, [*ckpt, "--parallel.cp", "2", "--parallel.dp_shard", "2"], job, world_size=4)
        shutil.rmtree(Path(job) / "checkpoints" / "step-000010")
        for got in run_distributed(run_tiny, [*ckpt, "--parallel.dp_shard", "2"], job, world_size=2):
            assert got["start"] == 5
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][5:]), **TOL)
    finally:
        shutil.rmtree(job, ignore_errors=True)


def test_cp_layout_is_described_and_checked():
    results = run_distributed(_layout, world_size=4)
    assert results[0]["describe"] == "dp_replicate(1) x dp_shard(2) x cp(2) x tp(1) x pp(1) = 4 ranks"
    assert results[0]["fsdp_size"] == 4 and results[0]["cp_size"] == 2


def _layout() -> dict:
    from plait.train import apply_overrides, load
    from plait.train.layout import build_meshes
    from plait.train.trainer import check as check_config

    _, dims = check_config(apply_overrides(load("tiny"), ["--parallel.cp", "2"]), 4)
    meshes = build_meshes(dims)
    return {"describe": dims.describe(), "fsdp_size": meshes.fsdp.size(), "cp_size": meshes.cp.size()}


@pytest.mark.parametrize(("world", "overrides", "match"), [
    (2, ["--parallel.cp", "2", "--training.seq_len", "30"], r"seq_len\(30\) is not divisible by 2 \* cp\(2\) = 4"),
    (4, ["--parallel.cp", "3"], r"dp_shard\(\?\) \* cp\(3\): the other dims multiply to 3, which does not divide"),
    (8, ["--parallel.cp", "2", "--parallel.tp", "4", "--training.seq_len", "20"],
     r"seq_len\(20\) / cp\(2\) = 10 is not divisible by tp\(4\)"),
])
def test_cp_layout_errors_name_the_numbers(world, overrides, match):
    from plait.train import apply_overrides, load
    from plait.train.trainer import check as check_config

    with pytest.raises(ValueError, match=match):
        check_config(apply_overrides(load("tiny"), overrides), world)


def test_print_config_shows_cp(monkeypatch, capsys):
    from plait.train.cli import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["--config", "tiny", "--parallel.cp", "2", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# dp_replicate(1) x dp_shard(2) x cp(2) x tp(1) x pp(1) = 4 ranks")
    assert "\ncp = 2\n" in printed
