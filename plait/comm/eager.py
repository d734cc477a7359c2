"""The door's eager entry points under torch.compile: one clean graph break, never a trace.

    compiled user code -> comm.all_reduce(t, group=g)
        dynamo tracing: is_compiling() -> the call runs eagerly, outside the graph (a graph
                        break, as for any eager-only function; no warning)
        eager:          is_compiling() is False -> the door as usual (one cheap check)

Traced, the door's bookkeeping (CommEvent's clock, Handle's lock, the groups' tables) is
code dynamo cannot follow: it broke the graph at each such line and warned on every rank.
Collectives that belong in a graph, DTensor's, take the traceable door instead
(plait/comm/functional.py): c10d's functional ops, seen by the same listeners.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_only(fn: F) -> F:
    """`fn`, run outside dynamo's trace when called from compiled code."""
    disabled = torch._disable_dynamo(fn)  # imports torch._dynamo at its first call only

    @functools.wraps(fn)
    def door(*args, **kwargs):
        if torch.compiler.is_compiling():  # dynamo is tracing this call
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return door  # type: ignore[return-value]


__all__ = ["eager_only"]
