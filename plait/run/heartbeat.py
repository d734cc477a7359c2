"""Agent heartbeats, so survivors notice a dead node in bounded time (pytorch#111646).

    every agent: a thread adds 1 to `hb/<node id>` every keep_alive_interval (own store connection)
    every agent: Liveness reads the counters of the nodes it depends on; a counter that has not
        moved for keep_alive_interval × keep_alive_max_attempt means that agent is gone
    an agent that exits on purpose sets its counter to -1: gone at once, no wait

Staleness is measured on the observer's own monotonic clock from the moment it saw the value
change, so clocks on different machines never need to agree.
"""

from __future__ import annotations

import threading
import time

from plait.run.store import RdzvStore, StoreLost

GONE = -1


def heartbeat_key(node_id: str) -> str:
    return f"hb/{node_id}"


class Heartbeat:
    """Beats for this node from a daemon thread until stopped."""

    def __init__(self, store: RdzvStore, node_id: str, interval: float):
        self._store = store  # a connection of its own: never queued behind the agent's calls
        self._key = heartbeat_key(node_id)
        self._interval = interval
        self._stop = threading.Event()
        self._store.add(self._key, 1)  # exists before this node is listed anywhere
        self._thread = threading.Thread(target=self._run, name="plait-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._store.add(self._key, 1)
            except StoreLost:
                return  # the agent's own calls will fail too, and it will say why

    def stop(self, *, gone: bool) -> None:
        """Stop beating; `gone=True` tells the others this node left on purpose."""
        self._stop.set()
        self._thread.join(timeout=self._interval + 5.0)
        if gone:
            try:
                self._store.set(self._key, str(GONE))
            except StoreLost:
                pass


class Liveness:
    """Which of the watched nodes are gone: left (counter -1) or silent for `timeout` seconds."""

    def __init__(self, store: RdzvStore, timeout: float):
        self._store = store
        self._timeout = timeout
        self._seen: dict[str, tuple[int, float]] = {}  # node id -> (last value, when it changed)

    def gone(self, node_ids) -> dict[str, str]:
        """{node id: why} for each gone node among `node_ids`."""
        now = time.monotonic()
        out = {}
        for node_id in node_ids:
            value = self._store.count(heartbeat_key(node_id))
            if value == GONE:
                out[node_id] = "its agent exited"
                continue
            last = self._seen.get(node_id)
            if last is None or last[0] != value:
                self._seen[node_id] = (value, now)
            elif now - last[1] >= self._timeout:
                out[node_id] = f"no heartbeat for {now - last[1]:.1f} s"
        return out
