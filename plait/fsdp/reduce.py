"""The reduce side of a ParamGroup: its unsharded gradients -> one reduce-scatter -> sharded .grad.

    post_backward: reshard (if asked) -> each parameter's unsharded grad rows into the (N, S)
                   rank-major reduce-scatter input in reduce_dtype, padding zeroed -> one async
                   reduce-scatter (sum) on the shard axis -> queued (ReduceQueue)
    queue:         issuing the next group's reduce-scatter, or the root's final callback,
                   waits for the one in flight -> finish_reduce
    finish_reduce: (S,) -> HSDP: all-reduce on the replicate axis (or kept, summed into the
                   next, while requires_all_reduce is off) -> / data-parallel size (gradient_divide_factor
                   when set: 1.0 sums) -> each
                   parameter's piece added to, or made, its sharded .grad; FSDP1's flat
                   parameter takes the whole (S,) as its .grad

Host cost: the per-parameter loops run at every reduction. For a parameter sharded on dim 0
(FSDPParam.rows_first) they do its work inline, in C calls; any other goes through
FSDPParam's methods. Autograd is switched off with the C call (torch.no_grad() is five Python
frames). GroupReduce is ParamGroup's base class (one object: the hot path pays no
delegation frame); the attributes it reads are ParamGroup's, documented in group.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait import comm
from plait.comm import device as streams_api
from plait.fsdp.param import set_grad
from plait.tensor.dtensor import _STRIDED, DTensor, _make_wrapper

if TYPE_CHECKING:
    from plait.fsdp.group import ParamGroup

_set_grad_enabled = torch._C._set_grad_enabled


class ReduceQueue:
    """Reduce-scatters in flight, shared by every group under one root. Issuing one waits
    for the one before, so a group's reduce-scatter overlaps the next group's backward and
    at most one reduce-scatter's buffers are alive."""

    def __init__(self) -> None:
        self.pending: list[tuple[ParamGroup, comm.Handle]] = []
        self._inputs: list[torch.Tensor | None] = []  # each one's input, kept until compute waited for it
        self._post: tuple[torch.device, object] | None = None  # the last drained group's event P

    def push(self, group: ParamGroup, handle: comm.Handle, rs_in: torch.Tensor | None = None) -> None:
        self._finish()
        self.pending.append((group, handle))
        self._inputs.append(rs_in)

    def drain(self) -> None:
        self._finish()
        if self._post is not None:  # the optimizer (on the compute stream) reads the grads
            device, event = self._post
            self._post = None
            streams_api.wait_event(streams_api.current_stream(device), event)

    def _finish(self) -> None:
        while self.pending:
            group, handle = self.pending.pop(0)
            rs_in = self._inputs.pop(0)
            streams = group.streams
            if streams is None:
                group.finish_reduce(handle.wait())
                continue
            rs = streams.reduce_scatter
            with streams_api.stream_context(rs):
                reduced = handle.wait()
                done = streams_api.record_event(rs)
                group.finish_reduce(reduced)
                self._post = (group.device, streams_api.record_event(rs))
            streams_api.wait_event(streams_api.current_stream(group.device), done)
            del rs_in  # compute is ordered after the collective read it: its memory may be reused


class GroupReduce:
    """ParamGroup's gradient path: pack, reduce-scatter, land."""

    def has_grads(self) -> bool:
        return any((p.unsharded is not None and p.unsharded.grad is not None) or p.acc_grad is not None
                   for p in self.params)

    def post_backward(self) -> None:
        """This group's gradients are complete: reshard if asked, then reduce-scatter them
        (queued; the next group's post-backward or the root's final callback waits for it)."""
        if self.reshard_after_backward:
            self.reshard()
        if not self.requires_gradient_sync:
            for p in self.params:
                p.accumulate_unsharded(self.reduce_dtype)
            return
        if not self.has_grads():
            return  # every rank skips alike: the group took no part in this backward
        n = self.world
        # (N, S); each parameter writes its block and zeroes its padding (no whole-buffer memset)
        rs_in = torch.empty(n, self.total, dtype=self.reduce_dtype, device=self.device)
        grad_was = torch.is_grad_enabled()
        _set_grad_enabled(False)  # a grad may require grad (backward with create_graph=True)
        try:
            for p, off, size in zip(self.params, self.offsets, self.sizes):
                dst = rs_in[:, off:off + size]  # (N, P): the unsharded rows, rank-major, then padding
                if p.rows_first and p.acc_grad is None:  # FSDPParam.pop_grad_rows, inline
                    unsharded = p.unsharded
                    grad = None if unsharded is None else unsharded.grad
                    if grad is not None:
                        unsharded.grad = None
                        rows = grad.reshape(-1)
                    else:
                        rows = None
                else:
                    rows = p.pop_grad_rows()
                if rows is None:
                    dst.zero_()
                    continue
                full, rem = p.grad_split
                if full:
                    dst[:full].copy_(rows[: full * size].view(full, size))
                if rem:
                    dst[full, :rem].copy_(rows[full * size:])
                    dst[full, rem:].zero_()
                if full + (rem > 0) < n:
                    dst[full + (rem > 0):].zero_()
        finally:
            _set_grad_enabled(grad_was)
        if self.streams is None:
            handle = comm.reduce_scatter(rs_in.view(-1), group=self.shard_group, async_op=True)  # -> (S,)
            self.queue.push(self, handle)
            return
        rs = self.streams.reduce_scatter
        streams_api.wait_stream(rs, streams_api.current_stream(self.device))  # grads copied in on compute
        with streams_api.stream_context(rs):
            handle = comm.reduce_scatter(rs_in.view(-1), group=self.shard_group, async_op=True)
        self.queue.push(self, handle, rs_in)

    def finish_reduce(self, reduced: torch.Tensor) -> None:
        """`reduced` (S,) is the sum over the shard axis; add the replicate axis (HSDP),
        average, and land every parameter's piece in its sharded .grad."""
        if self.replicate_group is not None:
            if self._partial is not None:
                reduced = reduced.add_(self._partial)
                self._partial = None
            if not self.requires_all_reduce:
                self._partial = reduced
                return
            comm.all_reduce(reduced, group=self.replicate_group)
        factor = self.gradient_divide_factor
        if factor is None:
            reduced.div_(self.dp_size)
        elif factor != 1.0:
            reduced.div_(factor)
        grad_dtype = self.grad_dtype
        if self.flat_param is not None:
            self._land_flat_grad(reduced, grad_dtype)
            return
        grad_was = torch.is_grad_enabled()
        _set_grad_enabled(False)
        try:
            for p, off, size in zip(self.params, self.offsets, self.sizes):
                piece = reduced[off:off + size]
                sharded = p.sharded
                grad, dtype = sharded.grad, p.orig_dtype
                if not (p.rows_first and (grad_dtype is None or grad_dtype == dtype)
                        and (grad is None or grad.dtype == dtype)):
                    p.take_shard_grad(piece, grad_dtype)
                    continue
                # FSDPParam.take_shard_grad, inline: the piece (its real rows) to the shard's
                # device and dtype, added to the sharded .grad or, a copy, made it
                local = piece[: p.local_numel].view(p.local_rows, *p.rest)
                device = (sharded._local if sharded._pending is None else sharded._local_tensor).device
                if grad is not None:
                    (grad._local if grad._pending is None else grad._local_tensor).add_(
                        local.to(device=device, dtype=dtype))
                    continue
                local = local.to(device=device, dtype=dtype, copy=True)  # not the whole output kept alive
                spec = sharded._spec
                new = _make_wrapper(DTensor, spec.shape, spec.stride, None, None, spec.dtype, _STRIDED,
                                    local.device, False, False)  # dtensor.wrap, inline
                new._local, new._pending, new._spec = local, None, spec
                sharded.grad = new
        finally:
            _set_grad_enabled(grad_was)

    def _land_flat_grad(self, reduced: torch.Tensor, grad_dtype: torch.dtype | None) -> None:
        """The reduced (S,) is the flat parameter's .grad (padding zero: the reduce-scatter
        input's padding was), or is added to the one kept from an earlier backward."""
        flat = self.flat_param
        dtype = grad_dtype or flat.dtype
        grad = flat.grad
        grad_was = torch.is_grad_enabled()
        _set_grad_enabled(False)
        try:
            if grad is None:
                set_grad(flat, reduced.to(device=flat.device, dtype=dtype))
            else:  # a low-precision grad adds the float32 sum and rounds once, as take_shard_grad
                grad.add_(reduced.to(device=grad.device, dtype=None if dtype != flat.dtype else dtype))
        finally:
            _set_grad_enabled(grad_was)


__all__ = ["GroupReduce", "ReduceQueue"]
