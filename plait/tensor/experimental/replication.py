"""implicit_replication(): inside it, a plain torch.Tensor that meets a DTensor in an op is
taken as a Replicate DTensor on that DTensor's mesh, instead of raising.

    with implicit_replication():
        y = x_dt * torch.arange(4.0)      # torch.arange(4.0) -> Replicate() on x_dt's mesh

The flag lives in plait.tensor.dispatch (`_allow_implicit_replication`, torch's name), which
reads it only when it meets such a tensor: calls without one pay nothing. The caller
promises the tensor is the same on every rank; nothing checks it (as in torch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from plait.tensor import dispatch


@contextmanager
def implicit_replication() -> Iterator[None]:
    """Treat plain tensors mixed with DTensors as replicated while the block runs.

    Nested blocks restore the flag they found (torch's resets it to False on any exit).
    """
    before = dispatch._allow_implicit_replication
    dispatch._allow_implicit_replication = True
    try:
        yield
    finally:
        dispatch._allow_implicit_replication = before


__all__ = ["implicit_replication"]
