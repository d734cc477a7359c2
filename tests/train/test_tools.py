"""`plait generate` samples from a trained checkpoint in one process; `plait plot` draws a run's
metrics log. The checkpoint comes from a 2-rank FSDP run of the tiny config, so generate reads
a sharded checkpoint whole."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from plait.generate import generate, load_checkpoint
from plait.generate import main as generate_main
from plait.testing import run_distributed
from tests.train.common import run_tiny


@pytest.fixture(scope="module")
def trained_run():
    job = tempfile.mkdtemp(prefix="plait-tools-")
    run_distributed(run_tiny, ["--checkpoint.enabled", "true", "--parallel.dp_shard", "2",
                               "--training.steps", "6", "--metrics.val_every", "3"], job, world_size=2)
    return Path(job)


def test_generate_continues_the_prompt_from_a_sharded_checkpoint(trained_run, capsys):
    ckpt = trained_run / "checkpoints" / "step-000006"
    model, tok, config = load_checkpoint(str(ckpt))
    assert config.training.steps == 6 and config.parallel.dp_shard == 2
    prompt = tok.encode(b"def ")[None, :]
    greedy = generate(model, prompt, max_new_tokens=20, temperature=0)
    assert greedy.shape == (1, 24) and torch.equal(greedy[:, :4], prompt)
    assert torch.equal(greedy, generate(model, prompt, max_new_tokens=20, temperature=0))
    assert generate_main([str(ckpt), "--prompt", "import ", "--max-new-tokens", "30"]) == 0
    assert capsys.readouterr().out.startswith("import ")


def test_generate_refuses_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    with pytest.raises(Exception, match="metadata|checkpoint"):
        load_checkpoint(str(tmp_path))


def test_plot_draws_loss_and_throughput(trained_run, tmp_path):
    pytest.importorskip("matplotlib")
    from plait.plot import main as plot_main
    from plait.plot import read_steps

    log = trained_run / "metrics.jsonl"
    steps = read_steps(log)
    assert [r["step"] for r in steps] == list(range(1, 7))
    assert [r["step"] for r in steps if r["val_loss"] is not None] == [3, 6]
    out = tmp_path / "run.png"
    assert plot_main([str(log), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
