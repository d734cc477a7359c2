"""DTensorSpec: everything about a DTensor except its local data.

    DTensorSpec(mesh, placements, shape, stride, dtype)   -- global shape and stride
        .local_shape / .local_offset                      -- this rank's piece, computed once

A spec is immutable and hashable (its hash is computed once), because it is the key of
every cache on the dispatch path: the sharding decision for an op is looked up by the
specs of its arguments, and the specs of its outputs come from that cache, so a steady
state training step creates no new spec at all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from plait.device_mesh import DeviceMesh
from plait.tensor.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
    local_shape_and_offset,
    shard_order,
)


class TensorMeta(NamedTuple):
    """torch's global tensor metadata of a spec (torch.distributed.tensor._dtensor_spec)."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


class ShardOrderEntry(NamedTuple):
    """One tensor dim and the mesh axes that cut it, in the order they cut (torch's)."""

    tensor_dim: int
    mesh_dims: tuple[int, ...]


class DTensorSpec:
    __slots__ = ("mesh", "placements", "shape", "stride", "dtype", "_hash", "_local", "_token")

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        shape: tuple[int, ...] | TensorMeta | None = None,
        stride: tuple[int, ...] | None = None,
        dtype: torch.dtype | None = None,
        *,
        tensor_meta: TensorMeta | None = None,
        shard_order: tuple[ShardOrderEntry, ...] | None = None,
    ) -> None:
        # torch's spelling, DTensorSpec(mesh, placements, tensor_meta=TensorMeta(...)), too
        if isinstance(shape, TensorMeta):
            tensor_meta, shape = shape, None
        if tensor_meta is not None:
            shape, stride, dtype = tensor_meta
        if shape is None or stride is None or dtype is None:
            raise ValueError("a DTensorSpec needs the global shape, stride and dtype (or tensor_meta=)")
        self.mesh = mesh
        self.placements = placements
        self.shape = torch.Size(shape)
        self.stride = tuple(stride)
        self.dtype = dtype
        self._hash: int | None = None
        self._local: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._token: int | None = None  # dispatch's int name for this value (dispatch._token)
        if shard_order is not None and tuple(shard_order) != self.shard_order:
            raise ValueError(f"shard_order {tuple(shard_order)} is not the order {list(placements)} cut in "
                             f"({self.shard_order}); plait orders cuts by placements (_StridedShard) only")

    @property
    def tensor_meta(self) -> TensorMeta:
        """torch's name for the global (shape, stride, dtype)."""
        return TensorMeta(self.shape, self.stride, self.dtype)

    @property
    def shard_order(self) -> tuple[ShardOrderEntry, ...]:
        """Per sharded tensor dim, the mesh axes that cut it in cutting order (torch's)."""
        order = shard_order(self.placements, self.mesh.shape)
        return tuple(ShardOrderEntry(dim, tuple(axes)) for dim, axes in sorted(order.items()))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def _local_info(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self._local is None:
            coordinate = self.mesh.get_coordinate()
            if coordinate is None:  # outside the mesh: an empty piece at no offset (torch's)
                self._local = ((0,), ())
                return self._local
            self._local = local_shape_and_offset(self.shape, self.placements, self.mesh.shape, coordinate)
        return self._local

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's local tensor."""
        return self._local_info()[0]

    @property
    def local_offset(self) -> tuple[int, ...]:
        """Where this rank's local tensor starts in the global tensor, per dim."""
        return self._local_info()[1]

    def is_replicated(self) -> bool:
        return all(type(p) is Replicate for p in self.placements)

    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def sharded_dims(self) -> set[int]:
        return {p.dim for p in self.placements if type(p) is Shard or type(p) is _StridedShard}

    def with_placements(self, placements: tuple[Placement, ...]) -> DTensorSpec:
        return DTensorSpec(self.mesh, tuple(placements), self.shape, self.stride, self.dtype)

    def _key(self) -> tuple:
        return (self.mesh, self.placements, self.shape, self.stride, self.dtype)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._key())
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DTensorSpec):
            return NotImplemented
        return hash(self) == hash(other) and self._key() == other._key()

    def __deepcopy__(self, memo: dict) -> DTensorSpec:
        return self  # immutable, and its mesh holds process groups that must not be copied

    __copy__ = __deepcopy__

    def __reduce__(self) -> tuple:
        # the caches stay behind: _token numbers this process's specs only
        return DTensorSpec, (self.mesh, self.placements, tuple(self.shape), self.stride, self.dtype)

    def __repr__(self) -> str:
        places = ", ".join(str(p) for p in self.placements)
        dtype = str(self.dtype).removeprefix("torch.")
        return f"DTensorSpec({dtype}{list(self.shape)} ({places}) on {self.mesh})"


def same_mesh(a: DeviceMesh, b: DeviceMesh) -> bool:
    return a is b or a == b


__all__ = ["DTensorSpec", "ShardOrderEntry", "TensorMeta", "same_mesh"]
