"""A resume continues the same run: a changed model is refused before anything loads, naming
the fields, and the checkpoint folder is left as it was (nothing pruned: the refused run saved
nothing of its own). Fine-tuning saved weights into a changed model is a new run, started from
them with --checkpoint.initial_load_path (the model only, from step 0).

One 1-rank run of the tiny config (4 steps, saving every 2, keep_latest_k 1) is shared by the
cases (a module fixture); each later run reads it and must not change it.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import plait.checkpoint as dcp
from plait.checkpoint import FileSystemReader
from plait.checkpoint.tools import full_tensor
from plait.testing import run_distributed
from tests.train.common import run_tiny

CKPT = ["--checkpoint.enabled", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "1",
        "--training.steps", "4", "--metrics.val_batches", "0"]


def _refused(overrides: list[str], job: str) -> str:
    """run_tiny's ValueError, as text (an exception would tear the pool down)."""
    try:
        run_tiny(overrides, job)
    except ValueError as e:
        return str(e)
    return "no error"


def _contents(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def job():
    job = tempfile.mkdtemp(prefix="plait-resume-model-")
    try:
        run_distributed(run_tiny, CKPT, job, world_size=1)
        assert [p.name for p in (Path(job) / "checkpoints").iterdir()] == ["step-000004"]
        yield job
    finally:
        shutil.rmtree(job, ignore_errors=True)


def test_resume_with_another_model_is_refused_and_the_folder_kept(job, capsys):
    folder = Path(job) / "checkpoints"
    before = _contents(folder)
    (msg,) = run_distributed(_refused, [*CKPT, "--training.steps", "6", "--model.ffn_dim", "256"], job, world_size=1)
    assert f"checkpoint {folder / 'step-000004'} holds another model than this run's: model.ffn_dim: 192 saved, " \
           "256 now." in msg, msg
    assert "--checkpoint.initial_load_path" in msg
    (msg,) = run_distributed(_refused, [*CKPT, "--training.steps", "6", "--model.n_layers", "3",
                                        "--model.dim", "32"], job, world_size=1)
    assert "model.dim: 64 saved, 32 now; model.n_layers: 2 saved, 3 now" in msg, msg
    assert _contents(folder) == before
    # the command line says it in one line, before any process group starts
    from plait.train import cli

    assert cli.main(["--config", "tiny", "--job.dir", job, *CKPT, "--model.ffn_dim", "256"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plait train: checkpoint ") and "model.ffn_dim: 192 saved, 256 now" in err, err
    assert _contents(folder) == before
    # the same model resumes (the name's default ffn_dim given explicitly is the same model); in a
    # copy: it saves and prunes
    copy = tempfile.mkdtemp(prefix="plait-resume-same-")
    try:
        shutil.copytree(job, copy, dirs_exist_ok=True)
        (got,) = run_distributed(run_tiny, [*CKPT, "--training.steps", "6", "--model.ffn_dim", "192"], copy,
                                 world_size=1)
        assert got["start"] == 4 and len(got["losses"]) == 2
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def test_initial_load_path_fine_tunes_the_weights_into_a_changed_model(job):
    source = Path(job) / "checkpoints" / "step-000004"
    before = _contents(source)
    new = tempfile.mkdtemp(prefix="plait-finetune-")
    try:
        # lr 0: the run's own final checkpoint holds the weights it started from
        start = ["--checkpoint.initial_load_path", str(source), "--training.lr", "0", "--training.steps", "1",
                 "--checkpoint.enabled", "true", "--metrics.val_batches", "0"]
        (got,) = run_distributed(run_tiny, [*start, "--model.n_layers", "3"], new, world_size=1)
        assert got["start"] == 0
        saved, reader = FileSystemReader(str(source)), FileSystemReader(str(Path(new) / "checkpoints" / "step-000001"))
        md_saved, md_new = saved.read_metadata(), reader.read_metadata()
        assert "app.model.layers.2.attention.wq.weight" in md_new.tensors
        for fqn in md_saved.tensors:
            if fqn.startswith("app.model."):
                assert torch.equal(full_tensor(reader, md_new, fqn), full_tensor(saved, md_saved, fqn)), fqn
        steps = [k for k in md_new.tensors if k.startswith("app.optim.state.layers.0.") and k.endswith(".step")]
        assert steps and all(full_tensor(reader, md_new, k).item() == 1 for k in steps)  # a fresh AdamW (saved: 4)
        assert all(full_tensor(saved, md_saved, k).item() == 4 for k in steps)
        # a tensor of another shape is an error even so, naming the key, both shapes, the checkpoint
        (msg,) = run_distributed(_refused, [*start, "--model.ffn_dim", "256"], tempfile.mkdtemp(dir=new), world_size=1)
        assert f"is float32[256, 64] but checkpoint {source} saved float32[192, 64]" in msg, msg
        assert _contents(source) == before
        other = str(Path(new) / "not-a-run")  # a checkpoint, but none of this model's tensors: not trained from scratch
        dcp.save({"x": torch.zeros(2)}, checkpoint_id=other)
        (msg,) = run_distributed(_refused, [*start, "--checkpoint.initial_load_path", other], tempfile.mkdtemp(dir=new),
                                 world_size=1)
        assert f"checkpoint {other} holds none of this model's 21 tensors" in msg, msg
    finally:
        shutil.rmtree(new, ignore_errors=True)


def test_prune_keeps_the_checkpoints_after_the_one_just_saved(tmp_path):
    """keep_latest_k counts back from the checkpoint this run committed: a newer one in the folder
    is not this run's to remove (it removed the run's own and kept the other)."""
    from plait.train.checkpointing import Checkpointer, step_dir

    for step in (10, 20, 30):
        step_dir(tmp_path, step).mkdir()
        (step_dir(tmp_path, step) / "metadata.json").write_text("{}")
    Checkpointer(tmp_path, async_mode=False, keep_latest_k=1, is_rank0=True)._prune(20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000020", "step-000030"]
