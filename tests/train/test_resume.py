"""Checkpoints: saved at step 5 on 8 ranks (dp_shard 2 x tp 2 x pp 2), resumed on 4 ranks with
another layout — FSDP 4 (data-parallel degree 2 -> 4, no TP, no pipeline), or tp 2 x pp 2
(dp 2 -> 1) — the next steps equal the uninterrupted 1-rank run, so the data stream continued
on the new dp degree without repeating or skipping a sample; the exported safetensors model
holds the full tensors.

The 8-rank run (once, a module fixture; each layout resumes from its own copy of the run folder)
trains 10 steps saving every 5 (async) and at the end; the step-10 checkpoint is then removed,
as if the job had died after step 5, so the 4-rank run finds step 5 as the latest complete
checkpoint. Tolerance: the parity tests' (rtol/atol 1e-5), the same float32 sums in
another order; the resumed state itself is exact (model, AdamW moments, step, data position).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from plait.testing import run_distributed
from tests.train.common import run_tiny
from tests.train.test_parity import TOL, reference

CKPT = ["--checkpoint.enabled", "true", "--checkpoint.interval", "5"]


@pytest.fixture(scope="module")
def saved_on_8_ranks():
    """The 8-rank run, once for both resume layouts (the same overrides, so the same run): its
    losses equal the 1-rank run's, it saved steps 5 and 10, and step 10 is removed."""
    job = tempfile.mkdtemp(prefix="plait-resume-saved-")
    try:
        first = run_distributed(run_tiny, [*CKPT, "--parallel.dp_shard", "2", "--parallel.tp", "2",
                                           "--parallel.pp", "2"], job, world_size=8)[0]
        torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(reference()["losses"]), **TOL)
        folder = Path(job) / "checkpoints"
        assert sorted(p.name for p in folder.iterdir()) == ["step-000005", "step-000010"]
        shutil.rmtree(folder / "step-000010")
        yield job
    finally:
        shutil.rmtree(job, ignore_errors=True)


@pytest.mark.parametrize("resume_layout", [
    ["--parallel.dp_shard", "4", "--checkpoint.export-safetensors"],
    ["--parallel.tp", "2", "--parallel.pp", "2", "--parallel.dp_shard", "1"],
], ids=["fsdp4", "tp_x_pp"])
def test_save_on_8_ranks_resume_on_4_with_another_layout(saved_on_8_ranks, resume_layout):
    ref = reference()
    job = tempfile.mkdtemp(prefix="plait-resume-")
    try:
        shutil.copytree(saved_on_8_ranks, job, dirs_exist_ok=True)  # each layout resumes its own copy
        resumed = run_distributed(run_tiny, [*CKPT, *resume_layout], job, world_size=4)
        for got in resumed:
            assert got["start"] == 5
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][5:]), **TOL)
            torch.testing.assert_close(got["val"][10], ref["val"][10], **TOL)
        if "--checkpoint.export-safetensors" in resume_layout:
            from safetensors.torch import load_file

            from plait.models.llama import Transformer
            from plait.train import load
            from plait.train.trainer import model_args

            hf = Path(job) / "hf"  # the Hugging Face layout, written by the 4 ranks
            weight_map = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
            tensors = {}
            for name in sorted(set(weight_map.values())):
                tensors.update(load_file(str(hf / name)))
            assert sorted(tensors) == sorted(weight_map)
            model = Transformer(model_args(load("tiny")))
            assert set(tensors) == set(model.state_dict())
            model.load_state_dict(tensors)  # full shapes, one process
    finally:
        shutil.rmtree(job, ignore_errors=True)


def _resume_point(folder: str, rank1_view: str) -> object:
    """agreed_latest on this rank, rank 1 seeing `rank1_view` of the folder: "stale" (its listing
    lags: step 3 is the latest it sees) or "blind" (step 6 not complete there)."""
    from plait import comm
    from plait.checkpoint import commit
    from plait.train import checkpointing

    saved = checkpointing.latest_complete, commit.status
    if comm.global_rank() == 1 and rank1_view == "stale":
        checkpointing.latest_complete = lambda f: (3, checkpointing.step_dir(f, 3))
    if comm.global_rank() == 1 and rank1_view == "blind":
        commit.status = lambda p: "not visible here" if p.endswith("step-000006") else saved[1](p)
    try:
        found = checkpointing.agreed_latest(folder, group=comm.world_group())
        return None if found is None else found[0]
    except RuntimeError as e:
        return str(e)
    finally:
        checkpointing.latest_complete, commit.status = saved


def test_every_rank_resumes_the_checkpoint_rank_0_chose(tmp_path):
    """A commit can land while the ranks look (a lost node's rank 0 finishing its save, a shared
    file system showing a new folder to one node first): the ranks must still load one step."""
    assert run_distributed(_resume_point, str(tmp_path), "stale", world_size=2) == [None, None]
    for step in (3, 6):
        (tmp_path / f"step-{step:06d}").mkdir()
        (tmp_path / f"step-{step:06d}" / "metadata.json").write_text("{}")
    (tmp_path / "step-000009.incomplete").mkdir()  # a save killed before its commit: never picked
    (tmp_path / "step-000012").mkdir()  # files without metadata.json (copied, or pruned halfway)
    assert run_distributed(_resume_point, str(tmp_path), "stale", world_size=2) == [6, 6]
    got = run_distributed(_resume_point, str(tmp_path), "blind", world_size=2)
    assert all(f"resumes {tmp_path / 'step-000006'}, but 1 of 2 ranks (the first: rank 1) do not see it "
               "complete" in g for g in got), got
    assert "(here: not visible here)" in got[1] and "(here:" not in got[0]


@pytest.mark.parametrize("save, resume", [
    (["--parallel.dp_replicate", "4", "--parallel.dp_shard", "1"], ["--parallel.dp_shard", "4"]),
    (["--parallel.dp_shard", "4"], ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "1",
                                    "--parallel.tp", "2"]),
], ids=["ddp4_to_fsdp4", "fsdp4_to_ddp2_x_tp2"])
def test_resume_across_ddp_and_fsdp(save, resume):
    """Plain replicated tensors (replicate) saved, Shard(0) DTensors (fully_shard) loaded, and the
    other way round (into DDP x TP's tp-sharded DTensors): the next steps equal the 1-rank run."""
    ref = reference()
    job = tempfile.mkdtemp(prefix="plait-resume-ddp-")
    try:
        run_distributed(run_tiny, [*CKPT, *save], job, world_size=4)
        shutil.rmtree(Path(job) / "checkpoints" / "step-000010")
        for got in run_distributed(run_tiny, [*CKPT, *resume], job, world_size=4):
            assert got["start"] == 5
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][5:]), **TOL)
            torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"][5:]),
                                       **TOL)
    finally:
        shutil.rmtree(job, ignore_errors=True)
