"""What the door reports: one `CommEvent` per collective or p2p op, to every listener.

    op called -> seq += 1 on its group -> [listeners] on_start(event) -> c10d op issued
              -> handle.wait() / future done -> event.end set -> [listeners] on_end(event)

A listener may raise in `on_start` to stop an op before anything is sent (the debug
layer's consistency check does). With no listener installed the door builds no event:
the cost is one empty-tuple check per op.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class CommEvent:
    """One collective or point-to-point op as this rank issued it."""

    op: str  # "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", ...
    group_name: str
    group_ranks: tuple[int, ...]  # global ranks of the group
    rank: int  # this process's rank within the group
    seq: int  # per-group sequence number on this rank, from 1
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[torch.dtype, ...]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[torch.dtype, ...]
    bytes_sent: int  # bytes this rank sends under the implementation used (see cost model)
    reduce_op: str | None = None
    peer: int | None = None  # group rank of the other side (p2p) or the root (broadcast, reduce)
    impl: str = "native"  # which implementation ran (see plait.comm.algorithms)
    async_op: bool = False
    start_ns: int = field(default_factory=time.perf_counter_ns)
    end_ns: int | None = None
    extra: dict = field(default_factory=dict)  # listeners may annotate (call site, trace id…)

    @property
    def duration_s(self) -> float | None:
        return None if self.end_ns is None else (self.end_ns - self.start_ns) / 1e9

    @property
    def completed(self) -> bool:
        return self.end_ns is not None


class CommListener:
    """Base class for listeners; override what you need. Called on the issuing thread
    (`on_end` may run on the backend's completion thread for futures)."""

    def on_start(self, event: CommEvent) -> None:
        pass

    def on_end(self, event: CommEvent) -> None:
        pass


_lock = threading.Lock()
_listeners: tuple[CommListener, ...] = ()


def listeners() -> tuple[CommListener, ...]:
    return _listeners


def add_listener(listener: CommListener) -> None:
    global _listeners
    with _lock:
        if listener not in _listeners:
            _listeners = (*_listeners, listener)


def remove_listener(listener: CommListener) -> None:
    global _listeners
    with _lock:
        _listeners = tuple(x for x in _listeners if x is not listener)


@contextlib.contextmanager
def listening(listener: CommListener) -> Iterator[CommListener]:
    """Install `listener` for the duration of the block."""
    add_listener(listener)
    try:
        yield listener
    finally:
        remove_listener(listener)


def emit_start(event: CommEvent) -> None:
    for listener in _listeners:
        listener.on_start(event)


def emit_end(event: CommEvent) -> None:
    event.end_ns = time.perf_counter_ns()
    for listener in _listeners:
        listener.on_end(event)
