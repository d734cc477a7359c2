"""The flight recorder: a ring of the last N ops this rank issued, each with its state.

    on_start -> Entry(event, site) into the ring: "scheduled", or "started" at once when no
             consistency check runs -> the door sets event.end_ns (or the watchdog sees the
             Work done) -> "completed"
    dump -> [entry.to_dict() for entry in ring], oldest first: formatted only here

Invariants: an entry holds the door's event and its call site — shapes, dtypes, strings,
ints, never a tensor; the event's c10d Work is dropped when the op completes (or its handle
is dropped) — so a full ring keeps no buffer alive. Timestamps are perf_counter_ns, written
as wall-clock nanoseconds, so the dumps of different ranks line up. Recording is one small
object and one deque append under the GIL, and no call at completion: on the hot path the
default-on recorder costs about a microsecond per op besides the call site's frame walk
(alone, it puts a tuple, and the Entry is made when a dump reads it: no Python frame per op).
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from plait.comm.events import CommEvent
from plait.debug.callsite import Site

SCHEDULED, STARTED, COMPLETED = "scheduled", "started", "completed"
P2P_OPS = frozenset({"send", "recv"})

ENTRY_IDS = itertools.count(1)  # entry ids, unique in this process whether or not a ring keeps them

# perf_counter_ns (what events carry) -> wall-clock ns; drift over a job is negligible
_WALL_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def wall_ns(perf_ns: int) -> int:
    return perf_ns + _WALL_OFFSET_NS


def dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


class Entry:
    """One op as this rank saw it: a view over the door's event, read when it is dumped.

    What the door measured (group, shapes, dtypes, bytes, times) stays in the event and is
    read through properties; recording an op stores four fields. A completed op is one whose
    event has its end time (the door sets it), so completion needs no call into the recorder.
    """

    __slots__ = ("id", "event", "site", "stack", "t_started", "_t_completed", "error")

    def __init__(self, id_: int, event: CommEvent, site: Site | None, stack: list[Site] | None,
                 t_started: int | None = None) -> None:
        self.id = id_
        self.event = event  # its Work is dropped when the op completes: no buffer outlives the op
        self.site = site
        self.stack = stack
        self.t_started = t_started  # perf_counter_ns, like every time here; to_dict writes wall-clock
        self._t_completed: int | None = None  # set by the watchdog, which sees a Work done before its wait
        self.error: str | None = None

    group = property(lambda self: self.event.group_name)
    group_ranks = property(lambda self: self.event.group_ranks)
    rank = property(lambda self: self.event.rank)
    seq = property(lambda self: self.event.seq)
    op = property(lambda self: self.event.op)
    peer = property(lambda self: self.event.peer)
    input_shapes = property(lambda self: self.event.input_shapes)
    input_dtypes = property(lambda self: self.event.input_dtypes)
    output_shapes = property(lambda self: self.event.output_shapes)
    output_dtypes = property(lambda self: self.event.output_dtypes)
    reduce_op = property(lambda self: self.event.reduce_op)
    bytes = property(lambda self: self.event.bytes_sent)
    impl = property(lambda self: self.event.impl)
    async_op = property(lambda self: self.event.async_op)
    t_scheduled = property(lambda self: self.event.start_ns)

    @property
    def t_completed(self) -> int | None:
        done = self._t_completed
        return self.event.end_ns if done is None else done

    @property
    def state(self) -> str:
        if self.t_completed is not None:
            return COMPLETED
        return SCHEDULED if self.t_started is None else STARTED

    def started(self) -> None:
        self.t_started = time.perf_counter_ns()

    def completed(self, end_perf_ns: int | None = None) -> None:
        if self.t_completed is None:
            self._t_completed = time.perf_counter_ns() if end_perf_ns is None else end_perf_ns

    def to_dict(self) -> dict:
        ranks = self.group_ranks
        peer = self.peer
        return {
            "id": self.id,
            "group": self.group,
            "group_ranks": list(ranks),
            "rank": self.rank,
            "global_rank": ranks[self.rank] if 0 <= self.rank < len(ranks) else None,
            "seq": self.seq,
            "op": self.op,
            "p2p": self.op in P2P_OPS,
            "peer": peer,
            "peer_global": ranks[peer] if peer is not None and 0 <= peer < len(ranks) else None,
            "input_shapes": [list(s) for s in self.input_shapes],
            "input_dtypes": [dtype_name(d) for d in self.input_dtypes],
            "output_shapes": [list(s) for s in self.output_shapes],
            "output_dtypes": [dtype_name(d) for d in self.output_dtypes],
            "reduce_op": self.reduce_op,
            "bytes": self.bytes,
            "impl": self.impl,
            "async_op": self.async_op,
            "state": self.state,
            "time_scheduled_ns": wall_ns(self.t_scheduled),
            "time_started_ns": None if self.t_started is None else wall_ns(self.t_started),
            "time_completed_ns": None if self.t_completed is None else wall_ns(self.t_completed),
            "duration_ms": None if self.t_completed is None else (self.t_completed - self.t_scheduled) / 1e6,
            "site": list(self.site) if self.site else None,
            "stack": [list(f) for f in self.stack] if self.stack else None,
            "error": self.error,
        }


def new_entry(event: CommEvent, site: Site | None, stack: list[Site] | None = None,
              t_started: int | None = None) -> Entry:
    return Entry(next(ENTRY_IDS), event, site, stack, t_started)


class FlightRecorder:
    """The last `capacity` ops of this rank, oldest first."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"flight recorder capacity must be > 0, got {capacity}")
        self.capacity = capacity
        # Entries, or (id, event, site, stack, t_started) tuples put by the session's hot path
        # through `append` (the deque's own, a C call): their Entry is made when read
        self._ring: deque[Entry | tuple] = deque(maxlen=capacity)
        self.append = self._ring.append
        self.total = 0  # ops recorded since start, evicted ones included; `append`'s caller counts

    def record(self, event: CommEvent, site: Site | None, stack: list[Site] | None = None,
               t_started: int | None = None) -> Entry:
        entry = Entry(next(ENTRY_IDS), event, site, stack, t_started)
        self._ring.append(entry)  # one C call; the deque drops the oldest when full
        self.total += 1
        return entry

    def entries(self) -> list[Entry]:
        # deque.copy runs in C under the GIL: a consistent snapshot
        return [e if type(e) is Entry else Entry(*e) for e in self._ring.copy()]

    def snapshot(self) -> list[dict]:
        return [e.to_dict() for e in self.entries()]

    @property
    def dropped(self) -> int:
        return self.total - len(self._ring)

    def clear(self) -> None:
        self._ring.clear()
        self.total = 0
