"""Shape and dtype of what crosses a stage boundary, and how two stages agree on it once.

    first step: stage s runs F on microbatch 0 -> metas of its outputs
        --send: [n] then int64 [n entries]--> stage s+1 allocates its receive buffers from them
    later: every send is checked against the metas (a mismatch names stage, microbatch, shapes)

The wire form is a flat int64 tensor, `[count, (dtype code, ndim, *shape) per tensor]`,
preceded by its length: no pickle crosses between ranks. A gradient has its tensor's shape
and dtype, so backward buffers need no exchange of their own; which tensors get one follows
from the dtype alone (floating or complex), so both sides agree without asking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributed import ProcessGroup

from plait import comm

# Wire codes; append only (codes are positions).
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODE = {d: i for i, d in enumerate(_DTYPES)}


class TensorMeta(NamedTuple):
    """What a receiver needs to allocate a buffer, and what a sender is checked against."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), t.dtype)

    @property
    def differentiable(self) -> bool:
        """Whether a gradient flows back for this tensor (and so is sent and received)."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    def empty(self, device: torch.device | str) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{tuple(self.shape)} {dtype}"


def encode(metas: Sequence[TensorMeta]) -> torch.Tensor:
    """The int64 wire form of `metas`."""
    values = [len(metas)]
    for m in metas:
        if m.dtype not in _CODE:
            raise TypeError(f"pipeline stages cannot exchange tensors of dtype {m.dtype}")
        values += [_CODE[m.dtype], len(m.shape), *m.shape]
    return torch.tensor(values, dtype=torch.int64)


def decode(wire: torch.Tensor) -> tuple[TensorMeta, ...]:
    values = wire.tolist()
    count, pos, metas = values[0], 1, []
    for _ in range(count):
        code, ndim = values[pos : pos + 2]
        metas.append(TensorMeta(tuple(values[pos + 2 : pos + 2 + ndim]), _DTYPES[code]))
        pos += 2 + ndim
    assert pos == len(values), "metadata wire form is corrupt"
    return tuple(metas)


def send_metas(metas: Sequence[TensorMeta], *, dst: int, group: ProcessGroup) -> list[comm.Handle]:
    """Start sending `metas` to group rank `dst` (two messages: length, then entries)."""
    wire = encode(metas).to(comm.group_device(group))
    length = torch.tensor([wire.numel()], dtype=torch.int64, device=wire.device)
    return [comm.isend(length, dst=dst, group=group), comm.isend(wire, dst=dst, group=group)]


def recv_metas(*, src: int, group: ProcessGroup) -> tuple[TensorMeta, ...]:
    """Receive what `send_metas` sent from group rank `src` (blocks)."""
    dev = comm.group_device(group)
    length = comm.recv(torch.empty(1, dtype=torch.int64, device=dev), src=src, group=group)
    wire = comm.recv(torch.empty(int(length.item()), dtype=torch.int64, device=dev), src=src, group=group)
    return decode(wire)


def check_same(
    expected: Sequence[TensorMeta], got: Sequence[TensorMeta], what: str, source: str
) -> None:
    """Raise ValueError naming `what` ("stage 1, microbatch 3: output") unless shapes and
    dtypes agree; `source` says where `expected` came from."""
    if len(expected) != len(got):
        raise ValueError(
            f"{what}s: {len(got)} tensors, but {source} had {len(expected)} "
            f"({', '.join(map(str, expected))})"
        )
    for k, (e, g) in enumerate(zip(expected, got)):
        if e.shape != g.shape or e.dtype != g.dtype:
            raise ValueError(f"{what} {k} has shape {g}, but {source} had {e}")
