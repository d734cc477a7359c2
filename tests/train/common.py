"""Run the trainer on pool ranks: the tiny config, no progress bar, a run folder per call."""

from __future__ import annotations

import tempfile

from plait.tensor.debug import fallback_policy
from plait.train import apply_overrides, load, train

QUIET = ["--metrics.progress", "false"]


def run_tiny(overrides: list[str], job_dir: str | None = None) -> dict:
    """Train the tiny config with `overrides` on this pool's ranks; rank's view of the result."""
    job_dir = job_dir or tempfile.mkdtemp(prefix="plait-train-")
    config = apply_overrides(load("tiny"), [*QUIET, "--job.dir", job_dir, *overrides])
    with fallback_policy("error"):  # every layout's every DTensor op has a sharding rule
        result = train(config)
    return {"losses": result.losses, "val": result.val_losses, "start": result.start_step,
            "graph_breaks": result.graph_breaks, "summary": result.summary,
            "grad_norms": [r.grad_norm for r in result.records]}
