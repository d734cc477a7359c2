"""CommDebugMode: count the collectives (and bytes) that code inside a block issues.

    with CommDebugMode() as mode:
        loss = model(x).sum(); loss.backward()
    mode.get_total_counts()                 # 2
    mode.get_comm_counts()["all_reduce"]    # 1  (comm.all_reduce works as a key too)

A listener on `plait.comm`: it sees exactly what passes the door, so whatever issued the
op — DTensor, a strategy, user code through plait.comm — is counted the same way.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from plait.comm import events


def _op_name(key: Any) -> str:
    """Accept "all_reduce" or the function plait.comm.all_reduce as a key."""
    return key if isinstance(key, str) else getattr(key, "__name__", str(key))


class CommCounts(Counter):
    """A Counter keyed by op name that also accepts the plait.comm function as key."""

    def __getitem__(self, key: Any) -> int:
        return super().__getitem__(_op_name(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(_op_name(key))


class CommDebugMode(events.CommListener):
    """Context manager counting collectives by op and bytes sent by this rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.comm_counts: CommCounts = CommCounts()
        self.comm_bytes: CommCounts = CommCounts()
        self.events: list[events.CommEvent] = []

    def on_start(self, event: events.CommEvent) -> None:
        with self._lock:
            self.comm_counts[event.op] += 1
            self.comm_bytes[event.op] += event.bytes_sent
            self.events.append(event)

    def get_total_counts(self) -> int:
        """Number of collective and p2p ops issued inside the block."""
        return sum(self.comm_counts.values())

    def get_comm_counts(self) -> CommCounts:
        """Op name -> number of calls."""
        return CommCounts(self.comm_counts)

    def get_comm_bytes(self) -> CommCounts:
        """Op name -> bytes this rank sent (per the implementation used)."""
        return CommCounts(self.comm_bytes)

    def get_total_bytes(self) -> int:
        return sum(self.comm_bytes.values())

    def __enter__(self) -> CommDebugMode:
        events.add_listener(self)
        return self

    def __exit__(self, *exc: object) -> None:
        events.remove_listener(self)
