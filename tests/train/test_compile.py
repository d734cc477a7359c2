"""`--compile` equals eager: each block torch.compile-d (after activation checkpointing, before
FSDP), FSDP on 2 ranks, 3 steps of the tiny config, losses and grad norms against the same
layout in eager mode; and no graph break inside a block.

The test compiles with backend "aot_eager": dynamo's capture and AOT autograd's joint graph,
where composition with plait's FSDP hooks and DTensor shows (graph breaks, wrong grads), without
inductor's C++ codegen, which on a cold cache took over 120 s on this 2-core machine under load.
With inductor (warm cache, measured by hand): 1 rank, dp_shard 2 and tp 2 all ran with 0 graph
breaks and losses within 1.2e-6 of eager over 4 steps. Tolerance rtol/atol 1e-5, as the parity
tests: the compiled graph may fuse or reorder float32 sums.
"""

from __future__ import annotations

import torch

from plait.testing import run_distributed
from tests.train.common import run_tiny

TOL = dict(rtol=1e-5, atol=1e-5)
BASE = ["--parallel.dp_shard", "2", "--training.steps", "3", "--metrics.val_batches", "0",
        "--activation_checkpoint.mode", "every", "--activation_checkpoint.every", "2"]


def test_compiled_blocks_under_fsdp_equal_eager():
    eager = run_distributed(run_tiny, BASE, world_size=2)[0]
    compiled = run_distributed(run_tiny, [*BASE, "--compile.enabled", "true", "--compile.backend", "aot_eager"],
                               world_size=2)
    for got in compiled:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(eager["losses"]), **TOL)
        torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(eager["grad_norms"]), **TOL)
        assert got["graph_breaks"] == 0
        assert "graph breaks  0" in got["summary"]
