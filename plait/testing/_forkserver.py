"""What the pool's forkserver loads once, so that no rank process pays for it again.

    forkserver: import _worker (torch, torch._dynamo, plait.comm) -> warm Dynamo -> fork ranks

Every rank is forked from this process, so what it has imported and initialised is shared
copy-on-write. Dynamo's first compile in a process imports and builds what every later one
reuses (AOT autograd, the functionalization passes, the trace rules): measured 1.3 CPU s
for the first aot_eager compile of a 4x4 matmul in a fresh process against 0.1 s for the
next. Without the warm-up every rank of every pool that runs a compile test pays it. The
invariant: the warm-up leaves nothing a test can see. Dynamo is reset and its counters
cleared after it, it is skipped on a build with CUDA (CUDA and autograd's device threads
do not survive a fork), and it runs on one thread (as every rank does) so that no OpenMP pool is
started before the fork. A warm-up that fails is reported on stderr and the ranks compile
cold: a broken torch.compile then fails the compile tests (and tests/testing's warm-up
test), not every multi-rank test.

This module is only ever imported by the forkserver (the pool names it as the preload);
the test process imports `_worker` alone.
"""

from __future__ import annotations

import sys

import torch
import torch._dynamo
from torch._dynamo.utils import counters

import plait.testing._worker  # noqa: F401 - the ranks' code, imported once here


def _warm_dynamo() -> None:
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w).sum()

    x = torch.randn(4, 4, device="cpu", requires_grad=True)  # the ranks run Gloo on CPU
    w = torch.randn(4, 4, device="cpu", requires_grad=True)
    torch.compile(block, backend="aot_eager", fullgraph=True)(x, w).backward()
    torch._dynamo.reset()
    counters.clear()


torch.set_num_threads(1)
# Not on a build with CUDA (seen on an H200): AOT autograd's joint tracing starts autograd's
# device threads, and even an inference compile initialises CUDA in this process; a forked rank
# then refuses its first backward ("Unable to handle autograd's threading in combination with
# fork-based multiprocessing") or its first compile ("Cannot re-initialize CUDA in forked
# subprocess"). There ranks compile cold, as they did before the warm-up.
if not torch.backends.cuda.is_built():
    try:
        _warm_dynamo()
    except Exception as e:  # noqa: BLE001 - a speed-up only: a broken compile fails the compile tests, not every test
        print(f"plait.testing: Dynamo warm-up in the forkserver failed ({type(e).__name__}: {e}); "
              "ranks will compile cold", file=sys.stderr)
