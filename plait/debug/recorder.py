"""The flight recorder: a ring of the last N ops this rank issued, each with its state.

    on_start -> Entry(state="scheduled") -> consistency check passed -> "started"
             -> on_end (or the watchdog sees the Work done) -> "completed"
    dump -> [entry.to_dict() for entry in ring], oldest first

Invariants: an entry holds plain data only — shapes, dtypes, strings, ints, never a tensor
or a c10d Work — so a full ring keeps no buffer alive; timestamps are taken with
perf_counter_ns and written as wall-clock nanoseconds, so the dumps of different ranks line up. Appending is one deque append under
the GIL: the default-on recorder costs a few microseconds per op.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from plait.comm.events import CommEvent
from plait.debug.callsite import Site

SCHEDULED, STARTED, COMPLETED = "scheduled", "started", "completed"
P2P_OPS = frozenset({"send", "recv"})

_IDS = itertools.count(1)  # entry ids, unique in this process whether or not a ring keeps them

# perf_counter_ns (what events carry) -> wall-clock ns; drift over a job is negligible
_WALL_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def wall_ns(perf_ns: int) -> int:
    return perf_ns + _WALL_OFFSET_NS


def dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


class Entry:
    """One op as this rank saw it."""

    __slots__ = (
        "id", "group", "group_ranks", "rank", "seq", "op", "peer", "input_shapes", "input_dtypes",
        "output_shapes", "output_dtypes", "reduce_op", "bytes", "impl", "async_op", "state",
        "t_scheduled", "t_started", "t_completed", "site", "stack", "error",
    )

    def __init__(self, id_: int, event: CommEvent, site: Site | None, stack: list[Site] | None) -> None:
        self.id = id_
        self.group = event.group_name
        self.group_ranks = event.group_ranks
        self.rank = event.rank
        self.seq = event.seq
        self.op = event.op
        self.peer = event.peer
        self.input_shapes = event.input_shapes
        self.input_dtypes = event.input_dtypes
        self.output_shapes = event.output_shapes
        self.output_dtypes = event.output_dtypes
        self.reduce_op = event.reduce_op
        self.bytes = event.bytes_sent
        self.impl = event.impl
        self.async_op = event.async_op
        self.state = SCHEDULED
        self.t_scheduled = event.start_ns  # perf_counter_ns, like t_started and t_completed;
        self.t_started: int | None = None  # converted to wall-clock ns by to_dict
        self.t_completed: int | None = None
        self.site = site
        self.stack = stack
        self.error: str | None = None

    def started(self) -> None:
        self.state = STARTED
        self.t_started = time.perf_counter_ns()

    def completed(self, end_perf_ns: int | None = None) -> None:
        if self.state != COMPLETED:
            self.state = COMPLETED
            self.t_completed = time.perf_counter_ns() if end_perf_ns is None else end_perf_ns

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


def new_entry(event: CommEvent, site: Site | None, stack: list[Site] | None = None) -> Entry:
    return Entry(next(_IDS), event, site, stack)


class FlightRecorder:
    """The last `capacity` ops of this rank, oldest first."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"flight recorder capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._ring: deque[Entry] = deque(maxlen=capacity)
        self.total = 0  # ops recorded since start, evicted ones included

    def record(self, event: CommEvent, site: Site | None, stack: list[Site] | None = None) -> Entry:
        entry = new_entry(event, site, stack)
        self._ring.append(entry)
        self.total += 1
        return entry

    def entries(self) -> list[Entry]:
        return list(self._ring.copy())  # deque.copy runs in C under the GIL: a consistent snapshot

    def snapshot(self) -> list[dict]:
        return [e.to_dict() for e in self.entries()]

    @property
    def dropped(self) -> int:
        return self.total - len(self._ring)

    def clear(self) -> None:
        self._ring.clear()
        self.total = 0
