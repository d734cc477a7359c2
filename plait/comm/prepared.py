"""A collective issued again and again on the same tensor (DDP's bucket all-reduce, its
buffers' broadcast every forward): the door's checks and constant facts done once, each issue
one frame.

    prepare_all_reduce(buffer, group=g)  -> checks (type, device, contiguity, op, dtype) and
                                            the event's constant fields, once
    op.start()   seq += 1 -> [listeners] on_start(CommEvent) -> ProcessGroup.allreduce (C++)
    op.wait()    Work.wait() -> event.end_ns -> [listeners that want it] on_end -> the buffer

The accounting is the door's, op for op: the same per-group sequence number, the same
CommEvent (op, shapes, dtypes, ring-model bytes, reduce op, async) to the same listeners,
the same end time; a listener may still stop the op in on_start. What it skips is what
cannot change between issues (the checks) and the layers around c10d's call: the door's
compile guard (the reducer issues from gradient hooks, which run eagerly), c10d's Python
wrapper (its checks are the door's; the op is never issued inside a coalescing manager), and
a Handle per issue. The object is its own handle, one op in flight at a time, and is known to
the exit hook (shutdown.py) from its creation, as a Handle is from its issue.

    prepare_broadcast(tensor, group=g)   -> the same checks, once
    op.run(src)  seq += 1 -> [listeners] on_start -> ProcessGroup.broadcast (C++) -> Work.wait()
                 -> [listeners] on_end: synchronous, as `broadcast(..., async_op=False)`, so
                 no Work outlives the call
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.distributed import ProcessGroup

from plait.comm import _c10d, checks, events, shutdown
from plait.comm.group import group_info

_OPS = {"sum": _c10d.ReduceOp.SUM, "avg": _c10d.ReduceOp.AVG, "max": _c10d.ReduceOp.MAX,
        "min": _c10d.ReduceOp.MIN, "product": _c10d.ReduceOp.PRODUCT}


class PreparedAllReduce:
    """`all_reduce(tensor, group=group, op=op, async_op=True)` on one fixed tensor, repeatedly."""

    __slots__ = ("tensor", "_wire", "_group", "_info", "_op", "_opts", "_bytes", "_shapes", "_dtypes",
                 "_work", "_done", "_event", "__weakref__")

    def __init__(self, tensor: torch.Tensor, *, group: ProcessGroup, op: str = "sum") -> None:
        info = group_info(group)
        checks.tensor(tensor, "tensor", info, in_place=True)
        if type(tensor) is not torch.Tensor:  # c10d's wrapper would dispatch a subclass's __torch_function__
            raise TypeError(f"a prepared all-reduce takes a plain torch.Tensor, got {type(tensor).__name__}")
        self._op = checks.reduce_op(op, tensor.dtype, info.backend)
        if tensor.is_complex() and self._op not in ("sum", "avg"):
            raise ValueError(f"all_reduce does not support {self._op} on complex tensors")
        self._wire = torch.view_as_real(tensor) if tensor.is_complex() else tensor  # as c10d sends it
        self.tensor, self._group, self._info = tensor, group, info
        n = info.size
        self._bytes = int(2 * (n - 1) / n * tensor.numel() * tensor.element_size())
        self._shapes, self._dtypes = (tuple(tensor.shape),), (tensor.dtype,)
        self._opts = _c10d.AllreduceOptions()
        self._opts.reduceOp = _OPS[self._op]
        self._opts.asyncOp = True
        self._work: Any = None  # the c10d Work while in flight (the exit hook reads it)
        self._done = True
        self._event: events.CommEvent | None = None
        shutdown.track(self)

    def start(self) -> PreparedAllReduce:
        """Issue the all-reduce of `tensor` (in place); `wait()` before the next start."""
        assert self._done, "a prepared all-reduce is issued again before its wait"
        info = self._info
        info.seq += 1
        event = None
        if events._listeners:  # events.emit_start, inline
            event = events.CommEvent(
                op="all_reduce", group_name=info.name, group_ranks=info.ranks, rank=info.rank, seq=info.seq,
                input_shapes=self._shapes, input_dtypes=self._dtypes, output_shapes=self._shapes,
                output_dtypes=self._dtypes, bytes_sent=self._bytes, reduce_op=self._op, async_op=True)
            for listener in events._listeners:
                listener.on_start(event)
        self._event = event
        if len(info.ranks) > 1:
            self._work = self._group.allreduce([self._wire], self._opts)
            if event is not None:
                event.work = self._work
        self._done = False
        return self

    def wait(self) -> torch.Tensor:
        """Block until the op completes; the reduced tensor."""
        if not self._done:
            if self._work is not None:
                self._work.wait()
                self._work = None  # a held Work holds the op's buffers
            self._done = True
            event = self._event
            if event is not None:  # events.emit_end, inline
                self._event = event.work = None
                event.end_ns = time.perf_counter_ns()
                for listener in events._enders:
                    listener.on_end(event)
        return self.tensor

    def __del__(self, _dropped=shutdown.dropped) -> None:
        # bound at definition, as Handle.__del__: collected during finalization
        if not self._done and self._work is not None:
            _dropped(self._work)


class PreparedBroadcast:
    """`broadcast(tensor, src=src, group=group)` on one fixed tensor, repeatedly (any root)."""

    __slots__ = ("tensor", "_wire", "_group", "_info", "_bytes", "_shapes", "_dtypes", "_opts")

    def __init__(self, tensor: torch.Tensor, *, group: ProcessGroup) -> None:
        info = group_info(group)
        checks.tensor(tensor, "tensor", info, in_place=True)
        if type(tensor) is not torch.Tensor:
            raise TypeError(f"a prepared broadcast takes a plain torch.Tensor, got {type(tensor).__name__}")
        native = checks.is_native(tensor.dtype, info.backend)
        self._wire = tensor if native else tensor.view(-1).view(torch.uint8)  # as comm.broadcast sends it
        self.tensor, self._group, self._info = tensor, group, info
        self._bytes = tensor.numel() * tensor.element_size()
        self._shapes, self._dtypes = (tuple(tensor.shape),), (tensor.dtype,)
        self._opts: dict[int, Any] = {}  # root -> c10d BroadcastOptions

    def run(self, src: int) -> torch.Tensor:
        """Copy group rank `src`'s `tensor` into `tensor` on every rank; returns it when done."""
        info = self._info
        info.seq += 1
        event = None
        if events._listeners:  # events.emit_start, inline
            event = events.CommEvent(
                op="broadcast", group_name=info.name, group_ranks=info.ranks, rank=info.rank, seq=info.seq,
                input_shapes=self._shapes, input_dtypes=self._dtypes, output_shapes=self._shapes,
                output_dtypes=self._dtypes, bytes_sent=self._bytes if info.rank == src else 0, peer=src)
            for listener in events._listeners:
                listener.on_start(event)
        if info.size > 1:
            opts = self._opts.get(src)
            if opts is None:
                if not 0 <= src < info.size:
                    raise ValueError(f"src {src} is not a rank of group {info.name} (size {info.size})")
                opts = self._opts[src] = _c10d.BroadcastOptions()
                opts.rootRank, opts.rootTensor, opts.asyncOp = src, 0, False
            work = self._group.broadcast([self._wire], opts)
            if event is not None:
                event.work = work
            work.wait()
            del work  # a held Work holds the op's buffers
        if event is not None:  # events.emit_end, inline
            event.work = None
            event.end_ns = time.perf_counter_ns()
            for listener in events._enders:
                listener.on_end(event)
        return self.tensor


def prepare_broadcast(tensor: torch.Tensor, *, group: ProcessGroup) -> PreparedBroadcast:
    """A broadcast of `tensor` over `group` to issue many times (`run(src)`)."""
    return PreparedBroadcast(tensor, group=group)


def prepare_all_reduce(tensor: torch.Tensor, *, group: ProcessGroup, op: str = "sum") -> PreparedAllReduce:
    """An all-reduce of `tensor` over `group` to issue many times (`start()`, then `wait()`)."""
    return PreparedAllReduce(tensor, group=group, op=op)


__all__ = ["PreparedAllReduce", "PreparedBroadcast", "prepare_all_reduce", "prepare_broadcast"]
