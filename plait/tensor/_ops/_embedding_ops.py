"""plait.tensor._ops._embedding_ops — torch's `_MaskPartial`: the placement of an embedding
looked up in a vocabulary-sharded (row-wise) weight.

Each rank looks up the indices that fall in its rows (`offset_shape` is the weight's global
shape, `offset_dim` the sharded dim) and zeros the rest, so the global value is the sum of
the ranks' pieces: a Partial("sum"), reduced and compared as torch's (equal when the
reduce op, offset_shape and offset_dim are). plait's embedding rule masks inside its local
function and labels its output a plain Partial("sum"); this class is the name torch's
callers construct and test with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.tensor.placement import Partial


@dataclass(frozen=True, slots=True)
class _MaskPartial(Partial):
    offset_shape: torch.Size | None = None
    offset_dim: int = 0

    def __init__(self, reduce_op: str | None = None, mask_buffer: object = None,  # noqa: ARG002 - torch's
                 offset_shape: torch.Size | None = None, offset_dim: int = 0) -> None:
        object.__setattr__(self, "reduce_op", reduce_op or "sum")
        object.__setattr__(self, "offset_shape", None if offset_shape is None else torch.Size(offset_shape))
        object.__setattr__(self, "offset_dim", int(offset_dim))
        if self.reduce_op != "sum":
            raise ValueError(f"_MaskPartial sums the ranks' masked lookups; reduce_op {self.reduce_op!r}")

    def __repr__(self) -> str:
        return f"MaskPartial(offset_shape={self.offset_shape}, offset_dim={self.offset_dim})"

    def __str__(self) -> str:
        return "MaskP"


__all__ = ["_MaskPartial"]
