"""Keeping replicas equal outside backward: check shapes, broadcast states, agree on a root.

    start-up   verify_shapes: all-gather every rank's (fqn order, shape, dtype) table
               -> the first difference raises on every rank, naming the tensor
               broadcast_coalesced(params + buffers, src=0): one flat tensor per dtype
    forward    BufferBroadcast(buffers).run(src=root) (BatchNorm running stats): the same
               broadcasts, a lone tensor of its dtype in place through a prepared broadcast
    join       find_common_rank: all-reduce MAX of candidate ranks -> the root

Every function here is a collective over `group`: all ranks call it, in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed import ProcessGroup

from plait import comm

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # torch DDP's broadcast_bucket_size

_DTYPE_CODES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)


def _encode(named: Sequence[tuple[str, torch.Tensor]]) -> list[int]:
    """Per tensor: ndim, *shape, dtype code."""
    out: list[int] = []
    for _, t in named:
        code = _DTYPE_CODES.index(t.dtype) if t.dtype in _DTYPE_CODES else 99
        out += [t.dim(), *t.shape, code]
    return out


def _decode(flat: list[int]) -> list[tuple[tuple[int, ...], int]]:
    entries, k = [], 0
    while k < len(flat):
        ndim = flat[k]
        entries.append((tuple(flat[k + 1:k + 1 + ndim]), flat[k + 1 + ndim]))
        k += ndim + 2
    return entries


def _describe(entry: tuple[tuple[int, ...], int] | None) -> str:
    if entry is None:
        return "no such tensor"
    shape, code = entry
    dtype = _DTYPE_CODES[code] if code < len(_DTYPE_CODES) else "another dtype"
    return f"shape {shape} ({dtype})"


def verify_shapes(named: Sequence[tuple[str, torch.Tensor]], group: ProcessGroup) -> None:
    """Raise on every rank if any rank's tensors differ in count, shape or dtype from rank 0's."""
    if comm.get_world_size(group) == 1:
        return
    dev = comm.group_device(group)
    mine = torch.tensor(_encode(named), dtype=torch.int64, device=dev)
    lengths = comm.all_gather(torch.tensor([mine.numel()], device=dev), group=group).tolist()
    everyone = comm.all_gather(mine, group=group, sizes=lengths)
    tables, start = [], 0
    for length in lengths:
        tables.append(_decode(everyone[start:start + length].tolist()))
        start += length
    reference = tables[0]
    for rank, table in enumerate(tables[1:], start=1):
        if table == reference:
            continue
        k = next(k for k in range(max(len(table), len(reference)))
                 if k >= len(table) or k >= len(reference) or table[k] != reference[k])
        name = named[k][0] if k < len(named) else f"tensor #{k}"
        raise ValueError(
            f"DistributedDataParallel needs the same parameters and buffers on every rank: "
            f"{name} has {_describe(reference[k] if k < len(reference) else None)} on rank 0 but "
            f"{_describe(table[k] if k < len(table) else None)} on rank {rank} "
            f"({len(reference)} tensors on rank 0, {len(table)} on rank {rank})"
        )


def _chunks(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """`tensors` grouped by dtype and device, each group split at `bucket_bytes`."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        chunks = groups.setdefault(key, [[]])
        nbytes = t.numel() * t.element_size()
        if chunks[-1] and sizes[key] + nbytes > bucket_bytes:
            chunks.append([])
            sizes[key] = 0
        chunks[-1].append(t)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [chunk for chunks in groups.values() for chunk in chunks]


@torch.no_grad()
def _broadcast_flat(chunk: list[torch.Tensor], src: int, group: ProcessGroup, is_src: bool) -> None:
    flat = _flatten_dense_tensors([t.detach() for t in chunk])
    comm.broadcast(flat, src=src, group=group)
    if not is_src:
        for t, value in zip(chunk, _unflatten_dense_tensors(flat, chunk)):
            t.copy_(value)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], *, src: int, group: ProcessGroup,
                        bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Copy group rank `src`'s values into `tensors` on every rank, one flat broadcast per
    dtype and device (split at `bucket_bytes`)."""
    if comm.get_world_size(group) == 1 or not tensors:
        return
    is_src = comm.get_rank(group) == src
    for chunk in _chunks(tensors, bucket_bytes):
        _broadcast_flat(chunk, src, group, is_src)


class BufferBroadcast:
    """`broadcast_coalesced` of one list of tensors, every forward: the same chunks and
    broadcasts, planned once. A chunk of one contiguous plain tensor (a model's lone buffer of
    its dtype) is broadcast in place by a prepared broadcast: no flat copy either way, no
    door checks per call. Valid while `matches` the list (re-read each forward, as torch
    does: a module may reassign its buffers, pytorch#63916)."""

    def __init__(self, tensors: Sequence[torch.Tensor], group: ProcessGroup,
                 bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
        self.tensors = list(tensors)
        self._shapes = [t.shape for t in self.tensors]
        self._group = group
        self._size = comm.get_world_size(group)
        self._rank = comm.get_rank(group)
        self._plan: list[comm.PreparedBroadcast | list[torch.Tensor]] = [
            comm.prepare_broadcast(chunk[0], group=group)
            if len(chunk) == 1 and type(chunk[0]) is torch.Tensor and chunk[0].is_contiguous() else chunk
            for chunk in _chunks(self.tensors, bucket_bytes)
        ] if self._size > 1 else []

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether `tensors` are this plan's, the same objects in the same shapes."""
        mine = self.tensors
        return len(tensors) == len(mine) and all(
            a is b and a.shape == shape for a, b, shape in zip(tensors, mine, self._shapes))

    def run(self, src: int) -> None:
        """Copy group rank `src`'s values into the tensors on every rank."""
        for step in self._plan:
            if step.__class__ is list:
                _broadcast_flat(step, src, self._group, self._rank == src)
            else:
                step.run(src)


def find_common_rank(group: ProcessGroup, candidate: bool) -> int:
    """The largest group rank among the ranks that pass `candidate=True`."""
    me = torch.tensor([comm.get_rank(group) if candidate else -1], dtype=torch.int64, device=comm.group_device(group))
    comm.all_reduce(me, group=group, op="max")
    rank = int(me.item())
    assert rank >= 0, "at least one rank is a candidate"
    return rank
