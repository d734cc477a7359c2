"""Collectives while torch.compile traces DTensor code: plait.comm's traceable door.

    eager:   redistribute -> plait.comm (checks, listeners, CommDebugMode)
    traced:  redistribute -> plait.comm.functional -> c10d functional collective ops in
             the graph, bracketed by plait ops that report to the same listeners when
             the compiled graph runs (see plait/comm/functional.py)

When AOTAutograd traces through DTensor's dispatch, local tensors are fake (no data), and
plait.comm's eager c10d calls cannot run on them; the graph holds c10d's functional ops
instead, and CommDebugMode, the flight recorder and DETAIL's checks see them at run time.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from plait.comm.functional import all_gather, all_reduce, all_to_all, reduce_scatter


def is_traced(t: torch.Tensor) -> bool:
    """Whether `t` is a tracing stand-in (fake or functional) rather than real data."""
    return isinstance(t, FakeTensor) or torch._is_functional_tensor(t) or type(t).__name__ == "FunctionalTensor"


__all__ = ["all_gather", "all_reduce", "all_to_all", "is_traced", "reduce_scatter"]
