"""NCCL parity on the GPUs present: DDP, FSDP2, TP, PP and a 2-D `plait train` each train like
one device. Skipped at collection without CUDA (nothing here runs on the CPU suite).

Each check starts `plait run --nproc-per-node W tests/gpu/workers.py NAME` with
W = min(device_count, 2 or 4) (one process per GPU, NCCL) and reads rank 0's figures: the
largest |loss difference| over 3 SGD steps and the largest |parameter difference| at the end,
against the same model trained on one GPU. TF32 is off, so the differences are float32
summation order only: CPU parity measures them below 1e-6 on this model (tests/ddp, tests/fsdp);
TOL = 1e-5 leaves 10x for GPU reduction orders. With one GPU, W = 1: DDP, FSDP and TP run as
one-rank groups (the NCCL path, the streams); PP and the 2-D trainer need 2 and 4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available: the NCCL parity tests need at least one GPU", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("workers.py")
GPUS = torch.cuda.device_count()
TOL = 1e-5
TIMEOUT_S = 180  # each launch is bounded: a hang fails the test with the launcher's output


def launch(nproc: int, *args: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix="plait-gpu-")) / "out.json"
    env = {**os.environ, "PLAIT_TIMEOUT": "120"}
    proc = subprocess.run([sys.executable, "-m", "plait", "run", "--nproc-per-node", str(nproc), str(WORKER),
                           args[0], str(out), *args[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ["ddp", "fsdp", "tp"])
def test_strategy_on_nccl_trains_like_one_gpu(name):
    got = launch(min(GPUS, 4), name)
    assert got["steps"] == 3
    assert got["loss_diff"] <= TOL and got["param_diff"] <= TOL, got


@pytest.mark.skipif(GPUS < 2, reason=f"pipeline parallel needs 2 GPUs, {GPUS} present")
def test_pipeline_on_nccl_trains_like_one_gpu():
    got = launch(2, "pp")
    assert got["loss_diff"] <= TOL and got["param_diff"] <= TOL, got


@pytest.mark.skipif(GPUS < 2, reason=f"a 2-D layout needs 2 GPUs, {GPUS} present")
def test_plait_train_2d_on_nccl_matches_one_gpu():
    world = min(GPUS, 4)
    steps = ["--training.steps", "5"]
    one = launch(1, "train", *steps, "--job.dir", tempfile.mkdtemp())
    layout = ["--parallel.dp_shard", str(world // 2), "--parallel.tp", "2"]
    many = launch(world, "train", *steps, *layout, "--job.dir", tempfile.mkdtemp())
    assert len(many["losses"]) == len(one["losses"]) == 5
    # the tiny config's CPU parity is within 1.4e-6 (tests/train/test_parity.py); GPU: same 1e-5
    torch.testing.assert_close(torch.tensor(many["losses"]), torch.tensor(one["losses"]), rtol=TOL, atol=TOL)
