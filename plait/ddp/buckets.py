"""Buckets: which gradients travel together, and the flat buffer each group owns.

    params in expected ready order -> assign_buckets(caps) -> [[param index, ...], ...]
        (reverse registration order at first; the order the gradients really became
         ready once one iteration has run, as torch rebuilds them)
    -> Bucket: one flat buffer per bucket; each gradient is a view at its offset
    -> GradBucket: what a comm hook sees (buffer, gradients, parameters, index, is_last)

Sizes are those of the local shards (plait.ddp.shards): a DTensor parameter's bucket slot
holds its local gradient, of its local shape.

Invariant: every rank holds the same buckets in the same order (the same parameters at
the same offsets, one dtype and device per bucket), and buckets are launched strictly in
index order, so the k-th all-reduce of an iteration is the same bucket on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from plait.ddp.shards import as_grad, local

MiB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES


def assign_buckets(params: Sequence[torch.Tensor], order: Sequence[int], caps: Sequence[int]) -> list[list[int]]:
    """Group `params[i]`, for i in `order`, into buckets of one dtype and device each.

    A bucket closes once its bytes reach its cap; the parameter that crosses the cap stays
    in it, as in torch (a parameter larger than the cap gets a bucket of its own). The k-th
    bucket of a dtype has cap `caps[min(k, len(caps) - 1)]`: a small first bucket starts
    communication early. Buckets come back in the order they fill (the position in `order`
    of their last member), so launching them in index order never waits on a later one.
    """
    if not caps or any(c <= 0 for c in caps):
        raise ValueError(f"bucket caps {list(caps)} must be one or more positive byte counts")
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed_count: dict[tuple[torch.dtype, torch.device], int] = {}
    done: list[tuple[int, list[int]]] = []  # (position of the last member, members)
    for pos, i in enumerate(order):
        p = local(params[i])
        key = (p.dtype, p.device)
        open_.setdefault(key, []).append(i)
        sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
        k = closed_count.get(key, 0)
        if sizes[key] >= caps[min(k, len(caps) - 1)]:
            done.append((pos, open_.pop(key)))
            sizes[key] = 0
            closed_count[key] = k + 1
    end = len(order)
    done.extend((end, members) for members in open_.values() if members)
    done.sort(key=lambda item: item[0])  # stable: leftover buckets keep first-seen order
    return [members for _, members in done]


class Bucket:
    """One bucket: its parameters and a flat buffer holding their gradients back to back.

    `views[k]` is `params[k]`'s gradient shape over `buffer`; with gradient_as_bucket_view
    the parameters' `.grad`s are these very views.
    """

    def __init__(self, index: int, param_indices: list[int], params: list[torch.nn.Parameter],
                 fqns: list[str]) -> None:
        assert param_indices, "a bucket holds at least one parameter"
        self.index = index
        self.param_indices = param_indices
        self.params = params
        self.fqns = fqns
        shards = [local(p) for p in params]
        first = shards[0]
        assert all(p.dtype == first.dtype and p.device == first.device for p in shards)
        self.offsets: list[int] = []
        total = 0
        for p in shards:
            self.offsets.append(total)
            total += p.numel()
        self.shapes = [p.shape for p in shards]
        self.buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.views = [self.buffer.narrow(0, o, p.numel()).view(p.shape) for o, p in zip(self.offsets, shards)]
        # the whole-bucket path's keys (intake.py): the members' identities in bucket order,
        # and whether each is a plain tensor (a DTensor's gradient goes through its shard)
        self.ids = [id(p) for p in params]
        self.plain = all(s is p for s, p in zip(shards, params))
        # per iteration, owned by the reducer
        self.pending = len(params)
        self.work: object | None = None  # what wait() gives the result: the prepared all-reduce, a comm Handle or a torch Future
        self.all_reduce: object | None = None  # the reducer's comm.PreparedAllReduce of `buffer`

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def __repr__(self) -> str:
        return f"Bucket({self.index}, {self.nbytes} bytes, {self.fqns})"


def build_buckets(params: Sequence[torch.nn.Parameter], fqns: Sequence[str],
                  assignment: list[list[int]]) -> list[Bucket]:
    return [Bucket(b, idx, [params[i] for i in idx], [fqns[i] for i in idx]) for b, idx in enumerate(assignment)]


def move_grad_views(old: Sequence[Bucket], new: Sequence[Bucket]) -> None:
    """After a rebuild: `.grad`s that were views of the old buckets become views of the new
    ones, values kept (gradient_as_bucket_view stays true across the rebuild)."""
    new_views = {i: b.views[k] for b in new for k, i in enumerate(b.param_indices)}
    for bucket in old:
        for i, p, view in zip(bucket.param_indices, bucket.params, bucket.views):
            if p.grad is not None and local(p.grad).data_ptr() == view.data_ptr():
                new_views[i].copy_(local(p.grad))
                p.grad = as_grad(p, new_views[i])


class GradBucket:
    """What a comm hook receives; torch's `dist.GradBucket` by method name and meaning.

    `buffer()` is the flat gradient tensor (not divided by the world size), `gradients()`
    its per-parameter views, in the order of `parameters()` (local shards' shapes for
    DTensor parameters, which `parameters()` returns as they are). `process_group` (a plait
    extra) is the group DDP reduces over, which a hook given `state=None` uses.
    """

    def __init__(self, bucket: Bucket, buffer: torch.Tensor, *, is_last: bool,
                 process_group: ProcessGroup) -> None:
        self._bucket = bucket
        self._buffer = buffer
        self._is_last = is_last
        self.process_group = process_group

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the flat buffer (a compression wrapper hands its hook a cast copy)."""
        if buffer.dim() != 1 or buffer.numel() != self._bucket.buffer.numel():
            raise ValueError(
                f"a bucket buffer must be flat with {self._bucket.buffer.numel()} elements, got "
                f"shape {tuple(buffer.shape)}"
            )
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._buffer.narrow(0, o, shape.numel()).view(shape)
                for o, shape in zip(self._bucket.offsets, self._bucket.shapes)]

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        """True for the bucket reduced last in an iteration."""
        return self._is_last

    def __repr__(self) -> str:
        return f"GradBucket(index={self.index()}, numel={self._buffer.numel()}, is_last={self._is_last})"
