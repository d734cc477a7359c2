"""What the door reports: one `CommEvent` per collective or p2p op, to every listener.

    op called -> seq += 1 on its group -> [listeners] on_start(event) -> c10d op issued
              -> handle.wait() / future done -> event.end_ns set -> [listeners that want it] on_end(event)

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
from typing import Any

import torch


@dataclass(slots=True)  # built for every op while a listener is installed: keep it lean
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
    # the c10d Work while the op is in flight (set by Handle, cleared when it completes), so a
    # watchdog can tell an op that finished but was not yet waited on from one that is stuck
    work: Any = field(default=None, repr=False, compare=False)

    @property
    def duration_s(self) -> float | None:
        return None if self.end_ns is None else (self.end_ns - self.start_ns) / 1e9

    @property
    def completed(self) -> bool:
        return self.end_ns is not None


class CommListener:
    """Base class for listeners; override what you need. Called on the issuing thread
    (`on_end` may run on the backend's completion thread for futures). A listener whose
    `wants_end` is False when it is installed is not called at completion: it reads
    `event.end_ns`, which the door sets, when it needs it (the flight recorder does)."""

    wants_end = True

    def on_start(self, event: CommEvent) -> None:
        pass

    def on_end(self, event: CommEvent) -> None:
        pass


_lock = threading.Lock()
_listeners: tuple[CommListener, ...] = ()  # every listener the door calls, in order
_enders: tuple[CommListener, ...] = ()  # those of them called at completion
# plait.debug's session (flight recorder, checks, watchdog): called first, so a check that
# stops an op does so before any other listener sees it; not one of `listeners()`
_debug: CommListener | None = None


def listeners() -> tuple[CommListener, ...]:
    """The listeners added with `add_listener` (plait.debug's own session is not among them)."""
    return _listeners if _debug is None else _listeners[1:]


def _set(listeners: tuple[CommListener, ...]) -> None:
    global _listeners, _enders
    _listeners = listeners
    _enders = tuple(x for x in listeners if getattr(x, "wants_end", True))


def add_listener(listener: CommListener) -> None:
    with _lock:
        if listener not in _listeners:
            _set((*_listeners, listener))


def remove_listener(listener: CommListener) -> None:
    with _lock:
        if listener is not _debug:
            _set(tuple(x for x in _listeners if x is not listener))


def set_debug_listener(listener: CommListener | None) -> None:
    """Install (or, with None, remove) plait.debug's session ahead of every other listener."""
    global _debug
    with _lock:
        others = _listeners if _debug is None else _listeners[1:]
        _debug = listener
        _set(others if listener is None else (listener, *others))


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
    for listener in _enders:
        listener.on_end(event)
